"""When the cadences (every N steps, epochs or minutes) say an action is due."""

from __future__ import annotations

import time

from modules.config.train_config import Cadence


class TimedAction:
    def __init__(self, cadence: Cadence, clock=time.monotonic):
        self.cadence = cadence
        self.clock = clock
        self.last_time = clock()

    def due(self, step: int, epoch_finished: bool, epochs_done: int) -> bool:
        """Asked after each optimizer step. `step` counts steps done; at an epoch's last step
        `epoch_finished` is true and `epochs_done` counts it."""
        value, unit = self.cadence.value, self.cadence.unit
        if value <= 0:
            return False
        if unit == "steps":
            return step % max(1, round(value)) == 0
        if unit == "epochs":
            return epoch_finished and epochs_done % max(1, round(value)) == 0
        if self.clock() - self.last_time >= value * 60:
            return True
        return False

    def done(self) -> None:
        self.last_time = self.clock()
