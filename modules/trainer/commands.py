"""TrainCommands: requests from outside the training loop (GUI buttons, stdin, signals).

Any thread may call these; the trainer takes them on the next gradient-accumulation boundary.
"""

from __future__ import annotations

import threading
from typing import Callable


class TrainCommands:
    ACTIONS = ("sample", "backup", "save")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pending: set[str] = set()
        self._prompts: list[dict] = []  # "sample now with this prompt" requests, in order
        # run (from any thread) before the process ends at once, skipping the main thread's unwinding
        # (the second Ctrl-C while the main thread is stuck in a long call): report, free the workspace
        self.quit_hooks: list[Callable[[], None]] = []

    def stop(self) -> None:
        self._stop.set()

    def sample_now(self, prompt: dict | None = None) -> None:
        """Sample the config's prompts, or only `prompt` (SamplePromptConfig fields) when given."""
        if prompt is None:
            self._request("sample")
            return
        with self._lock:
            self._prompts.append(prompt)

    def backup_now(self) -> None:
        self._request("backup")

    def save_now(self) -> None:
        self._request("save")

    def _request(self, action: str) -> None:
        with self._lock:
            self._pending.add(action)

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def take(self) -> set[str]:
        """The actions requested since the last call, cleared."""
        with self._lock:
            pending, self._pending = self._pending, set()
        return pending

    def take_prompts(self) -> list[dict]:
        """The prompts asked for with "sample now" since the last call, cleared."""
        with self._lock:
            prompts, self._prompts = self._prompts, []
        return prompts
