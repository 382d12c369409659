"""Parts the training step never runs (data/step_parts.py: a frozen text encoder whose text is
cached, a VAE whose latents are): they are on the train device while the caches are filled, then
leave it for the whole of training, and come back only while samples are made.

Leaving: the part's conductor (where it parks blocks) is evicted and taken out of the training
step's conductors, and every other tensor of the part (its non-block layers, the blocks it did not
park) goes to a home copy on the temp device (offload/home_copies.py: pinned where the device is
async). Coming back for samples: those tensors are copied to the train device again and the
parked blocks stream through the conductor's hooks as they did while caching, so a sample holds
of the part what caching did (the plan's `outside_step` figure), and afterwards everything points
back at its home.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from modules.data.step_parts import idle_parts
from modules.offload.conductor import LayerOffloadConductor
from modules.offload.home_copies import HomeCopies
from modules.offload.layer_tensors import layer_tensors

if TYPE_CHECKING:
    from modules.trainer.generic_trainer import GenericTrainer


class IdlePart:
    def __init__(self, name: str, homes: HomeCopies, conductor: LayerOffloadConductor | None):
        self.name, self.homes, self.conductor = name, homes, conductor

    def woken(self) -> None:
        self.homes.bring()

    def rest(self) -> None:
        if self.conductor is not None:
            self.conductor.evict()
        self.homes.send_home()


def rest_idle_parts(trainer: GenericTrainer, text_cached: bool) -> list[IdlePart]:
    """Each part the step never runs sent to the temp device (after the caches are filled)."""
    temp = torch.device(trainer.config.temp_device)
    if trainer.device == temp:  # (training on the host: there is no other place to go)
        return []
    names = idle_parts(trainer.config, trainer.family, trainer.trained_parts, text_cached)
    rested = []
    for name in names:
        if name in trainer.sharded:  # (a sharded part's slices are the processes'; it stays as it is)
            continue
        conductor = trainer.conductors.pop(name, None)  # (the step's evict/materialize no longer touch it)
        owned = conductor.owned_modules() if conductor is not None else set()
        if name in trainer.host_tables:  # (its token table is home already: offload/host_tables.py)
            owned = owned | trainer.host_tables[name].module_ids()
        tensors = [t for t in layer_tensors(trainer.family.parts[name]) if id(t.module) not in owned]
        part = IdlePart(name, HomeCopies(tensors, trainer.device, temp), conductor)
        part.rest()
        rested.append(part)
        trainer.callbacks.on_status(f"model.parts.{name}: not in the training step: on {trainer.config.temp_device} "
                                    f"while training ({part.homes.nbytes / 2**20:.1f} MiB off the train device), "
                                    f"back for samples")
    return rested


@contextlib.contextmanager
def idle_parts_woken(trainer: GenericTrainer):
    """Each idle part on the train device as it was while caching until the block ends, then back home."""
    woken = []
    try:
        for part in trainer.idle_parts:
            woken.append(part)
            part.woken()
        yield
    finally:
        for part in woken:
            part.rest()
