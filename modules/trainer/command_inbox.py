"""The command inbox: the run protocol's commands for a run from anyone, not only from the process
that holds its stdin (docs/run-protocol.md).

A run's stdin belongs to whoever started it; when that window closes, the pipe goes with it. The
inbox is a folder in the workspace, `<workspace_dir>/commands/`, where one command is one small
JSON file, the same object as one line on stdin (`{"command": "backup"}`). A sender writes it
atomically (a temp name beginning with "." renamed into place: `post_command`), so the run never
reads half a command. The run polls the folder on a thread while it holds the workspace lock,
parses each file with the protocol's one parser (`read_command`), hands the command to the same
`TrainCommands` stdin feeds (so it is applied at the same boundaries), and deletes the file. A bad
file is named in a warning and deleted; the run goes on. `launch.py remote` reads the local
workspace's inbox the same way and forwards each command to the run on the box (its stdin there).

Why a folder rather than a local socket: the workspace lock already guarantees one reader; it
needs no port or socket file to clean up after a killed run; it works the same on Windows, on a
network drive and over ssh (a file copied into the folder), and a user can stop a run from a shell
(`echo '{"command": "stop"}' > workspace/commands/stop.json`). Polling costs one directory listing
every quarter second. A file older than the run's process was left for an earlier run: it is
removed with a warning, not applied (a stop sent to a run that had already ended must not stop the
next one).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

from modules.util.atomic import write_text

INBOX_FOLDER = "commands"
MAX_BYTES = 64 * 1024  # a command is a few hundred bytes; more is not a command


def inbox_dir(workspace: str | os.PathLike) -> Path:
    return Path(workspace) / INBOX_FOLDER


def post_command(workspace: str | os.PathLike, command: str, prompt: dict | None = None) -> Path:
    """Write one command into the workspace's inbox (atomically); the file's path. Names sort in the
    order they were written, so the run applies them in that order."""
    message = {"command": command, **({"prompt": prompt} if prompt is not None else {})}
    path = inbox_dir(workspace) / f"{time.time_ns():020d}-{os.getpid()}-{command}.json"
    write_text(path, json.dumps(message) + "\n")
    return path


def _process_start_time() -> float:
    import psutil

    try:
        return psutil.Process().create_time()
    except psutil.Error:
        return time.time()


class CommandInbox:
    """Polls `<workspace>/commands/` on a daemon thread from `open()` to `close()`; each command read
    goes to `apply` (event_protocol.Command -> None), from that thread."""

    def __init__(self, workspace: str | os.PathLike, apply: Callable, warn: Callable[[str], None], poll_s: float = 0.25):
        self.folder = inbox_dir(workspace)
        self.apply = apply
        self.warn = warn
        self.poll_s = poll_s
        self.since = _process_start_time()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._undeletable: set[str] = set()  # reported once, then skipped

    def open(self) -> "CommandInbox":
        self.folder.mkdir(parents=True, exist_ok=True)
        self.collect()  # what was sent while the run was loading, at once
        self._thread = threading.Thread(target=self._loop, name="command-inbox", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _loop(self) -> None:
        while not self._closed.wait(self.poll_s):
            self.collect()

    def collect(self) -> list[str]:
        """Apply and delete every command file now in the folder, oldest name first; the names applied."""
        from modules.trainer.event_protocol import COMMANDS, read_command

        try:
            names = sorted(entry.name for entry in os.scandir(self.folder)
                           if entry.is_file() and not entry.name.startswith("."))  # ".": a write in progress
        except OSError:
            return []  # the folder was removed under the run: nothing to read
        applied = []
        for name in names:
            if name in self._undeletable:
                continue
            path = self.folder / name
            try:
                stat = path.stat()
                text = path.read_bytes()[:MAX_BYTES + 1].decode("utf-8", errors="replace")
            except OSError:
                continue  # taken away by its sender meanwhile
            if stat.st_mtime < self.since - 1.0:
                self.warn(f"{path}: a command file written before this run started (at "
                          f"{time.strftime('%H:%M:%S', time.localtime(stat.st_mtime))}) is not applied; removed")
                self._remove(path)
                continue
            command, problem = (None, f"larger than {MAX_BYTES} bytes") if len(text) > MAX_BYTES else read_command(text)
            removed = self._remove(path)
            if command is not None and removed:
                self.apply(command)
                applied.append(name)
            elif command is None:
                self.warn(f"ignored the command file {path}: {problem} (a file holds one JSON object, "
                          f"{{\"command\": one of {', '.join(COMMANDS)}}}, and for sample optionally "
                          f"\"prompt\": {{\"prompt\": ..., \"seed\": ...}}); removed")
        return applied

    def _remove(self, path: Path) -> bool:
        """Delete a read file; a file the run cannot delete is not applied (it would be applied again
        at every poll) and is reported once."""
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return True
        except OSError as error:
            self._undeletable.add(path.name)
            self.warn(f"{path}: cannot remove this command file ({error.strerror or error}), so it is not "
                      f"applied; make the folder writable for the run")
            return False
