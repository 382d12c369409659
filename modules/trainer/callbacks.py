"""TrainCallbacks: how a run reports what it does. The CLI prints, the JSONL protocol writes
events, the GUI queues them; the trainer only calls these methods (from the training thread)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    step: int  # optimizer steps done
    total_steps: int
    epoch: int  # 0-based
    epochs: int
    loss: float  # mean loss of the last optimizer step
    lr: float
    it_per_s: float
    eta_s: float


class TrainCallbacks:
    def on_started(self, total_steps: int) -> None: ...

    def on_status(self, text: str) -> None: ...

    def on_progress(self, progress: Progress) -> None: ...

    def on_sample(self, path: str) -> None: ...

    def on_backup(self, path: str) -> None: ...

    def on_save(self, path: str) -> None: ...

    def on_warning(self, message: str) -> None: ...

    def on_finished(self) -> None: ...
