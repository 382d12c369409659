"""A run the GUI started earlier that is still training after its window closed: found again from
its run folder, followed and stopped by a new window.

A window that starts a run writes the child's PID and creation time to `<run folder>/process.json`
(ui/run_client.py). A run is alive when that process still exists (the same creation time, so a
reused PID is not mistaken for it) or, for a folder without the file, when the workspace lock the
trainer holds (modules/saving/workspace_lock.py) names a live process on this host; and when its
event log has not ended (no finished or error event).

`AttachedRun` speaks to the window like a RunClient (`drain`, `running`, `send`, `stop`,
`returncode`): a reader thread replays the run's events.jsonl and log.txt from the start (so the
loss curve and gallery are whole) and then follows them. The child's stdin died with the old
window's end of that pipe, so commands (stop, sample, backup, save now) go to the run's command
inbox instead, a file each in `<workspace_dir>/commands/` (modules/trainer/command_inbox.py),
which the trainer reads at the same boundaries as stdin. Where that file cannot be written, stop
falls back to SIGTERM, which the trainer takes as the same stop request (modules/cli/stop_signals.py).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import threading
import time
from pathlib import Path

import psutil

from ui.run_client import COMMANDS, PROCESS_FILE, ROOT, EventFollower, decode_line
from ui.run_history import read_config, read_events, run_dirs

LOCK_NAME = "difftrainer.lock"  # modules/saving/workspace_lock.py's LOCK_NAME
ENDING_EVENTS = {"finished", "error"}


def _alive(pid, created) -> bool:
    try:
        process = psutil.Process(int(pid))
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return created is None or abs(process.create_time() - float(created)) < 1.0
    except (psutil.Error, TypeError, ValueError):
        return False


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def live_pid(run_dir: Path) -> int | None:
    """The PID of the run in `run_dir` if it still trains, else None."""
    if any(e.get("event") in ENDING_EVENTS for e in read_events(run_dir)):
        return None
    recorded = _read_json(run_dir / PROCESS_FILE)
    if recorded:
        return int(recorded["pid"]) if _alive(recorded.get("pid"), recorded.get("created")) else None
    workspace = (read_config(run_dir) or {}).get("workspace_dir")
    if not workspace:
        return None
    lock = _read_json(ROOT / Path(workspace).expanduser() / LOCK_NAME)
    if lock.get("host") == socket.gethostname() and _alive(lock.get("pid"), lock.get("created")):
        return int(lock["pid"])
    return None


def find_live_run(runs: Path) -> tuple[Path, int] | None:
    """The newest run folder whose run still trains, with its PID."""
    for run_dir in reversed(run_dirs(runs)):
        pid = live_pid(run_dir)
        if pid is not None:
            return run_dir, pid
    return None


class AttachedRun(EventFollower):
    """A live run followed from its files (see the module doc)."""

    attached = True

    def __init__(self, run_dir: Path, pid: int, poll_s: float = 0.1):
        self.run_dir, self.pid, self.poll_s = Path(run_dir), pid, poll_s
        self.events_path = self.run_dir / "events.jsonl"
        self.log_path = self.run_dir / "log.txt"
        self.events: queue.Queue = queue.Queue()
        self.returncode: int | None = None
        self._created = _read_json(self.run_dir / PROCESS_FILE).get("created")
        self._ending = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._read, name="attached-run-reader", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self.returncode is None

    def workspace(self) -> Path | None:
        """The run's workspace (relative paths are relative to the trainer's folder, the run's cwd)."""
        workspace = (read_config(self.run_dir) or {}).get("workspace_dir")
        return ROOT / Path(workspace).expanduser() if workspace else None

    def send(self, command: str, prompt: dict | None = None) -> bool:
        """One command into the run's inbox; False when the run is over or the file cannot be written."""
        from modules.trainer.command_inbox import post_command

        if command not in COMMANDS:
            raise ValueError(f"unknown command {command!r} (known: {', '.join(COMMANDS)})")
        workspace = self.workspace()
        if not self.running or workspace is None:
            return False
        try:
            post_command(workspace, command, prompt)
            return True
        except OSError:
            return False

    def stop(self) -> bool:
        if self.send("stop"):
            return True
        try:  # the inbox cannot be written: the signal is the same stop request
            os.kill(self.pid, signal.SIGTERM)
            return True
        except OSError:
            return False

    def detach(self) -> None:
        """Nothing to let go: the run never read this window's commands."""

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass

    def _read(self) -> None:
        pending = {"out": b"", "err": b""}
        seen: list[str] = []
        with open(self.events_path, "rb") as out, open(self.log_path, "rb") as err:
            while True:
                exited = not _alive(self.pid, self._created)  # read once more after the exit
                got = self._pump(out, "out", pending, seen) | self._pump(err, "err", pending, seen)
                if exited and not got:
                    break
                if not got:
                    time.sleep(self.poll_s)
        # not our child: no exit status to read; the event log says how it ended
        self.returncode = 0 if "finished" in seen and "error" not in seen else 1
        self.events.put(("exit", self.returncode))

    def _pump(self, stream, name: str, pending: dict[str, bytes], seen: list[str]) -> bool:
        data = stream.read()
        if not data:
            return False
        *lines, pending[name] = (pending[name] + data).split(b"\n")
        for line in lines:
            item = decode_line(name, line)  # as for a run the window started
            if item is None:
                continue
            self.events.put(item)
            if item[0] == "event":
                seen.append(item[1].get("event"))
        return True
