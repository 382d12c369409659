"""Plans the window's config off the Tk thread: `launch.py plan --config FILE --json` as a child
process (docs/cli.md), so planning (which imports torch and builds the architecture on the meta
device, seconds) never blocks the window and the GUI process stays torch-free.

`request(config_json, options)` (from the Tk thread) asks for a plan of that config (`options`: more
arguments of `launch.py plan`, such as `--vram 16GiB`); requests that arrive
while one is planned are coalesced: when the child ends, only the newest waiting request runs
next. Each finished plan goes on `results` as `(number, "ok", plan dict)` or
`(number, "error", message)`, where `number` is the request's (the panel shows only the newest).
One daemon thread runs the children; `close()` kills the running one. This module never touches Tk.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # a plan takes seconds; a child past this is stuck, not slow


def plan_argv(config_file: str | os.PathLike, options: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, str(ROOT / "launch.py"), "plan", "--config", str(config_file), *options, "--json"]


class PlanWorker:
    def __init__(self, argv_for: Callable[[Path, tuple[str, ...]], list[str]] = plan_argv):
        self.argv_for = argv_for
        self.results: queue.Queue = queue.Queue()
        self.requested = 0  # the number of the newest request
        self.planned = 0  # the number of the newest request whose plan (or error) is on `results`
        self._pending: tuple[int, str, tuple[str, ...]] | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._child: subprocess.Popen | None = None
        self._folder = Path(tempfile.mkdtemp(prefix="difftrainer-plan-"))
        self._thread = threading.Thread(target=self._loop, name="plan-worker", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self.planned < self.requested

    def request(self, config_json: str, options: tuple[str, ...] = ()) -> int:
        with self._wake:
            self.requested += 1
            self._pending = (self.requested, config_json, tuple(options))
            self._wake.notify()
            return self.requested

    def drain(self) -> list[tuple[int, str, object]]:
        """Every result queued so far, without blocking (call from the Tk main thread)."""
        items = []
        while True:
            try:
                items.append(self.results.get_nowait())
            except queue.Empty:
                return items

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
            child = self._child
        if child is not None and child.poll() is None:
            child.kill()
        self._thread.join(10)
        for file in self._folder.glob("*"):
            file.unlink(missing_ok=True)
        try:
            self._folder.rmdir()
        except OSError:
            pass

    # --- the worker thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                number, config_json, options = self._pending
                self._pending = None
            kind, payload = self._plan(config_json, options)
            if self._closed:
                return
            self.results.put((number, kind, payload))
            self.planned = number

    def _plan(self, config_json: str, options: tuple[str, ...]) -> tuple[str, object]:
        config_file = self._folder / "config.json"
        config_file.write_text(config_json, encoding="utf-8")
        try:
            with self._wake:
                if self._closed:
                    return "error", "closed"
                self._child = subprocess.Popen(self.argv_for(config_file, options), cwd=ROOT, stdin=subprocess.DEVNULL,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = self._child.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.communicate()
            return "error", f"launch.py plan took over {TIMEOUT_S} s"
        except OSError as error:
            return "error", f"launch.py plan could not start: {error}"
        finally:
            self._child = None
        if self._closed:
            return "error", "closed"
        lines = [line for line in err.strip().splitlines() if line.strip()]
        try:
            plan = json.loads(out)
        except json.JSONDecodeError:
            plan = None
        if not isinstance(plan, dict):
            # the CLI's error line (a config it refuses: "model.base: ...") is its last line on stderr
            return "error", lines[-1].removeprefix("error: ") if lines else "launch.py plan gave no plan"
        return "ok", plan
