"""How many bytes a run's backups and saved files will take, known before the model loads.

How the estimate is made (the preflight refuses a run whose disk cannot hold it):
- What the method trains: its `planned_size` (an adapter: modules/adapters/adapter_size.py; a
  fine-tune: modules/methods/fine_tune_size.py), from the checkpoint headers.
- The optimizer: its state bytes per trained parameter (modules/optim/state_size.py); the EMA
  keeps a float32 copy.
- A backup is adapter + optimizer state + EMA. `backup.rolling_count` of them stay, and the
  next is written before the oldest goes: rolling_count + 1 at once (one when backups are off:
  a stop still writes one). Saves every `save_every` stay (workspace/save/), each one adapter
  file in output.dtype, and the final output is one more.
Not counted: the latent and text cache (its size depends on the images and the family's
encoders) and tensorboard logs, both small next to the above for adapter training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from modules.adapters.adapter_size import AdapterSize
from modules.config.train_config import TrainConfig
from modules.optim.state_size import optimizer_state_bytes_per_parameter
from modules.util.torch_utils import dtype_of

_BACKUP_OVERHEAD = 1 << 16  # config.json, file headers, the scheduler and RNG states


@dataclass(frozen=True)
class PlannedBytes:
    backups: int  # in workspace_dir/backup, at the most
    backup_count: int
    saves: int  # in workspace_dir/save
    save_count: int
    output: int  # at output.path


def planned_bytes(config: TrainConfig, adapter: AdapterSize, steps: int | None) -> PlannedBytes:
    """What the run writes at the most, for an adapter of `adapter`'s size and about `steps`
    optimizer steps in all (None: unknown)."""
    schedule = config.schedule
    backup = adapter.nbytes + int(adapter.parameters * optimizer_state_bytes_per_parameter(config))
    if config.ema.enabled:
        backup += adapter.parameters * 4  # the float32 average
    backup_count = config.backup.rolling_count + 1 if schedule.backup_every.value > 0 else 1
    save_count = _count(schedule.save_every.value, schedule.save_every.unit, steps, schedule.epochs)
    one_file = adapter.elements * torch.empty((), dtype=dtype_of(config.output.dtype)).element_size()
    return PlannedBytes(backups=backup_count * (backup + _BACKUP_OVERHEAD), backup_count=backup_count,
                        saves=save_count * one_file, save_count=save_count, output=one_file)


def _count(every: float, unit: str, steps: int | None, epochs: int) -> int:
    if every <= 0:
        return 0
    if unit == "epochs":
        return math.floor(epochs / every)
    if unit == "steps" and steps is not None:
        return math.floor(steps / every)
    return 1  # minutes (or steps unknown): how many depends on the machine's speed


def planned_steps(config: TrainConfig, images_per_epoch: int) -> int:
    """Optimizer steps of the run: max_steps, or the epochs' batches (every resolution trains each image)."""
    schedule = config.schedule
    if schedule.max_steps:
        return schedule.max_steps
    samples = images_per_epoch * len(config.data.resolutions)
    batch = 1 if schedule.batch_size == "auto" else schedule.batch_size  # auto: at most this many steps
    per_epoch = math.ceil(math.ceil(samples / batch) / schedule.gradient_accumulation)
    return schedule.epochs * max(per_epoch, 1)


def describe(nbytes: int | float) -> str:
    value, unit = float(nbytes), "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
