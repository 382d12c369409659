"""SIGINT and SIGTERM for a headless run: the first asks it to stop, the second quits at once.

The first signal asks the run to stop at the next step (TrainCommands.stop); the phases that can
run for minutes (caching, sampling) check for it between their units of work. The second raises
KeyboardInterrupt in the main thread, which run_training turns into an `error` event and exit 130.

Python runs a signal handler only when the main thread is back in the interpreter: inside one
long torch call (a big step's backward, a 512-px step on the CPU) that can take a minute. So the
signals are also seen at once on a watcher thread, through the wakeup file descriptor Python's C
handler writes each signal number to: it makes the first one's stop request and message prompt,
and when the process still runs QUIT_GRACE_S after the second, it runs TrainCommands' quit hooks
(the error event, the workspace lock) and ends the process with os._exit. Files stay whole either
way: every file is written under a temporary name and renamed (modules/util/atomic.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable

from modules.trainer.commands import TrainCommands

EXIT_INTERRUPTED = 130  # as a shell reports a process ended by SIGINT
QUIT_GRACE_S = 2.0  # how long the main thread has to unwind after the second signal
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# true in every phase: stopped while loading or caching, no step has run and nothing is written
TRAINING_STOP = "stopping at the next step; a backup and the output are written if a step has run"


def _said(signum: int, doing: str) -> str:
    return f"[{signal.Signals(signum).name}: {doing}. Press Ctrl-C again to quit at once]"


def install_stop_signals(commands: TrainCommands, log: Callable[[str], None] = _stderr,
                         doing: str = TRAINING_STOP) -> None:
    """`doing`: what the first signal starts, as the message says it (a training run's by default)."""
    handled = []  # signals the main thread's handler has run for

    def on_signal(signum, _frame):
        handled.append(signum)
        if len(handled) == 1:
            commands.stop()  # (the watcher has made it already, and said so)
            if not watching:
                log(_said(signum, doing))
        else:
            raise KeyboardInterrupt

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    watching = _start_watcher(commands, log, doing)


_watch: dict = {}  # the watcher's run: commands, log, signals seen (one watcher per process)


def _start_watcher(commands: TrainCommands, log: Callable[[str], None], doing: str) -> bool:
    """Whether a watcher sees the signals (not where another wakeup fd, an event loop's, is set)."""
    if _watch:  # installed before in this process: the running watcher serves this run now
        _watch.update(commands=commands, log=log, doing=doing, seen=0)
        return True
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # the C handler must never block on a full pipe
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if previous != -1:  # someone else's: keep theirs, go without the watcher
        signal.set_wakeup_fd(previous)
        os.close(read_end), os.close(write_end)
        return False
    _watch.update(commands=commands, log=log, doing=doing, seen=0)

    def watch() -> None:
        while True:
            for signum in os.read(read_end, 64):
                if signum not in STOP_SIGNALS:
                    continue
                _watch["seen"] += 1
                if _watch["seen"] == 1:
                    _watch["commands"].stop()
                    _watch["log"](_said(signum, _watch["doing"]))
                elif _watch["seen"] == 2:
                    timer = threading.Timer(QUIT_GRACE_S, _quit_now, (_watch["commands"],))
                    timer.daemon = True  # a main thread that ends in time does not wait for it
                    timer.start()

    threading.Thread(target=watch, name="stop-signals", daemon=True).start()
    return True


def _quit_now(commands: TrainCommands) -> None:
    """The main thread did not end in time after the second signal (stuck in one long call)."""

    def run_hooks() -> None:
        for hook in commands.quit_hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001  (nothing may keep the process from ending now)
                pass
        sys.stdout.flush(), sys.stderr.flush()

    # on their own thread, waited for a moment: a hook blocked on a lock the stuck thread holds
    # (a write to a full pipe) must not keep the process alive
    hooks = threading.Thread(target=run_hooks, daemon=True)
    hooks.start()
    hooks.join(timeout=1.0)
    os._exit(EXIT_INTERRUPTED)
