"""A training run as a child process speaking the run protocol (docs/run-protocol.md).

`RunClient(argv, cwd)` is generic over the command line: a local run is
`local_train_argv(config_file)`; a remote one is any argv (e.g. `ssh host ...`) whose stdout
carries the same JSONL events and whose stdin takes the same commands.

The child's stdout and stderr go to files in `run_dir` (events.jsonl, log.txt), not to pipes:
a run the user leaves running when the window closes keeps writing there instead of dying on a
broken pipe, and the files stay as a record of the run. One reader thread tails both files and
puts `(kind, payload)` tuples on a queue:

- `("event", {...})` one decoded JSON event from stdout
- `("log", "text")`  a stderr line, or a stdout line that is not a JSON event
- `("exit", rc)`     the process ended and both files were read to the end (always last)

The GUI drains the queue on the Tk main thread (`after`); this module never touches Tk.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("stop", "sample", "backup", "save")
PROCESS_FILE = "process.json"  # the child's PID and creation time: ui/attached_run.py finds the run again by it


def local_train_argv(config_file: str | os.PathLike) -> list[str]:
    """`launch.py train --config FILE --protocol jsonl` with this interpreter, unbuffered."""
    return [sys.executable, "-u", str(ROOT / "launch.py"), "train", "--config", str(config_file), "--protocol", "jsonl"]


def record_process(run_dir: Path, pid: int, remote: bool = False) -> None:
    """Written by the window that starts the run: who to look for after a reopen, and whether the
    child relays a run on another machine (`launch.py remote`), which outlives the child itself."""
    try:
        created = psutil.Process(pid).create_time()
    except psutil.Error:
        return
    record = {"pid": pid, "created": created, **({"remote": True} if remote else {})}
    (run_dir / PROCESS_FILE).write_text(json.dumps(record), encoding="utf-8")


class EventFollower:
    """What the window reads from a run, whoever started it: a reader thread queues its events and
    log lines (RunClient here, ui/attached_run.py's AttachedRun) and sets `returncode` at its end."""

    events: queue.Queue
    returncode: int | None
    _thread: threading.Thread | None

    def wait(self, timeout: float | None = None) -> int | None:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.returncode

    def drain(self) -> list[tuple[str, object]]:
        """Everything queued so far, without blocking (call from the Tk main thread)."""
        items = []
        while True:
            try:
                items.append(self.events.get_nowait())
            except queue.Empty:
                return items


class RunClient(EventFollower):
    def __init__(self, argv: list[str], cwd: str | os.PathLike | None = None, run_dir: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, poll_s: float = 0.05, remote: bool = False):
        self.argv = list(argv)
        self.remote = remote  # the child relays a run on another machine (recorded for a later window)
        self.cwd = str(cwd or ROOT)
        self.run_dir = Path(run_dir) if run_dir else None
        self.env = env
        self.poll_s = poll_s
        self.events: queue.Queue = queue.Queue()
        self.process: subprocess.Popen | None = None
        self.returncode: int | None = None
        self._thread: threading.Thread | None = None
        self._stdin_lock = threading.Lock()

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self.process is not None:
            raise RuntimeError("this run was already started")
        if self.run_dir is None:
            import tempfile

            self.run_dir = Path(tempfile.mkdtemp(prefix="difftrainer-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events_path = self.run_dir / "events.jsonl"
        self.log_path = self.run_dir / "log.txt"
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.events_path, "wb") as out, open(self.log_path, "wb") as err:
            # a new session: Ctrl-C in the terminal that started the GUI does not reach the run,
            # and the run outlives the window when the user chooses to leave it running
            self.process = subprocess.Popen(self.argv, cwd=self.cwd, env=env, stdin=subprocess.PIPE,
                                            stdout=out, stderr=err, start_new_session=True)
        record_process(self.run_dir, self.process.pid, self.remote)  # so a window opened later finds the run again
        self._thread = threading.Thread(target=self._read, name="run-reader", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.returncode is None

    def send(self, command: str, prompt: dict | None = None) -> bool:
        """Send one command (stop, sample, backup, save; sample with its own `prompt`); False if the
        run no longer listens."""
        if command not in COMMANDS:
            raise ValueError(f"unknown command {command!r} (known: {', '.join(COMMANDS)})")
        if self.process is None or self.process.stdin is None:
            return False
        with self._stdin_lock:
            try:
                message = {"command": command, **({"prompt": prompt} if prompt is not None else {})}
                self.process.stdin.write((json.dumps(message) + "\n").encode())
                self.process.stdin.flush()
                return True
            except (BrokenPipeError, ValueError, OSError):
                return False

    def stop(self) -> bool:
        """Ask the run to stop at its next step; it writes a backup and its output, then exits."""
        return self.send("stop")

    def detach(self) -> None:
        """Leave the run going on its own: close its stdin (it stops reading commands, not training)."""
        if self.process is not None and self.process.stdin is not None:
            with self._stdin_lock:
                try:
                    self.process.stdin.close()
                except OSError:
                    pass

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    # --- the reader thread -------------------------------------------------------------------

    def _read(self) -> None:
        with open(self.events_path, "rb") as out, open(self.log_path, "rb") as err:
            pending = {"out": b"", "err": b""}
            while True:
                exited = self.process.poll() is not None  # read once more after the exit
                got = self._pump(out, "out", pending) | self._pump(err, "err", pending)
                if exited and not got:
                    break
                if not got:
                    time.sleep(self.poll_s)
            for name, rest in pending.items():
                if rest.strip():
                    self._line(name, rest)
        self.returncode = self.process.returncode
        self.events.put(("exit", self.returncode))

    def _pump(self, stream, name: str, pending: dict[str, bytes]) -> bool:
        data = stream.read()
        if not data:
            return False
        buffer = pending[name] + data
        *lines, pending[name] = buffer.split(b"\n")
        for line in lines:
            self._line(name, line)
        return True

    def _line(self, name: str, raw: bytes) -> None:
        item = decode_line(name, raw)
        if item is not None:
            self.events.put(item)


def decode_line(name: str, raw: bytes) -> tuple[str, object] | None:
    """A line of the run's stdout ("out") or stderr ("err") as a queue item, None for a blank one."""
    text = raw.decode("utf-8", errors="replace").rstrip("\r")
    if name == "out":
        try:
            event = json.loads(text)
        except json.JSONDecodeError:
            event = None
        if isinstance(event, dict) and "event" in event:
            return ("event", event)
    return ("log", text) if text.strip() else None
