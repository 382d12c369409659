"""Tensorboard scalars (loss, lr) into workspace/tensorboard/.

The writer is created on first use: importing tensorboard costs time and memory that the
run should not pay before its first step.
"""

from __future__ import annotations

from pathlib import Path


class ScalarLog:
    def __init__(self, folder: Path, enabled: bool):
        self.folder = Path(folder)
        self.enabled = enabled
        self._writer = None

    def add(self, step: int, **scalars: float) -> None:
        if not self.enabled:
            return
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.folder))
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
