"""One run per workspace: a lock file holding the owning process's PID and host.

Two runs on one workspace would interleave their backups, samples and config.json, so the second
is refused before it loads anything. A lock left by a run that was killed (kill -9, a power cut)
names a process that no longer exists on this host: it is reclaimed with a warning. A lock from
another host cannot be checked from here, so it is refused with the file named for the user to
remove. (A file lock (fcntl/msvcrt) would vanish with its process, but it does not work on every
network file system and tells the second run nothing about who holds it; the PID file does both.)
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

import psutil

from modules.errors import UserError

LOCK_NAME = "difftrainer.lock"


class WorkspaceBusyError(UserError):
    """Another live run holds the workspace."""


def _process_alive(pid: int, created: float | None) -> bool:
    """Whether the run that wrote the lock still runs: its PID exists and, where the lock records
    it, was created when that run was (so a PID reused by another program is not mistaken for it).
    psutil rather than os.kill(pid, 0): on Windows signal 0 is CTRL_C_EVENT, not a probe."""
    try:
        process = psutil.Process(pid)
        return created is None or abs(process.create_time() - created) < 1.0
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:  # exists, owned by another user
        return True


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # half-written by a run killed while creating it, or not ours: treat as stale
    return data if isinstance(data, dict) else None


class WorkspaceLock:
    """`acquire()` before the run writes into the workspace, `release()` when it ends."""

    def __init__(self, workspace: str | Path, warn: Callable[[str], None] = lambda text: None):
        self.path = Path(workspace) / LOCK_NAME
        self.warn = warn
        self.held = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "created": psutil.Process().create_time()}
        for _ in range(3):  # a stale lock removed by us (or a racing run) is retried
            try:
                handle = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._handle_existing(me)
                continue
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                json.dump(me, file)
            self.held = True
            return
        raise WorkspaceBusyError(f"could not take the lock {self.path} (another run keeps taking it)",
                                 field="workspace_dir")

    def _handle_existing(self, me: dict) -> None:
        owner = _read(self.path)
        if owner and owner.get("host") == me["host"] and owner.get("pid") == me["pid"]:
            self.path.unlink(missing_ok=True)  # this process's own lock from an earlier run in it
            return
        if owner and owner.get("host") != me["host"]:
            raise WorkspaceBusyError(
                f"{self.path.parent} is in use by a run on host {owner.get('host')!r} (PID {owner.get('pid')}, "
                f"lock file {self.path}); use another workspace_dir, or delete the lock file if that run has ended",
                field="workspace_dir")
        pid = owner.get("pid") if owner else None
        created = owner.get("created") if owner else None
        if isinstance(pid, int) and _process_alive(pid, created if isinstance(created, (int, float)) else None):
            raise WorkspaceBusyError(
                f"{self.path.parent} is in use by another run (PID {pid}, since {owner.get('started', '?')}; "
                f"lock file {self.path}); wait for it to end or stop it, or use another workspace_dir",
                field="workspace_dir")
        self.warn(f"workspace_dir: reclaimed the lock {self.path} of a run that no longer exists "
                  f"(PID {pid if pid is not None else '?'})")
        self.path.unlink(missing_ok=True)

    def release(self) -> None:
        if not self.held:
            return
        owner = _read(self.path)
        self.held = False
        if owner and owner.get("pid") == os.getpid():
            try:
                self.path.unlink(missing_ok=True)
            except OSError as error:
                # release runs as a failed run unwinds (a workspace gone read-only): raising here would
                # hide the write that stopped the run; a lock left behind is reclaimed by the next run
                self.warn(f"workspace_dir: could not remove the lock file {self.path} ({error.strerror or error}); "
                          "the next run reclaims it, as this process will have ended")
