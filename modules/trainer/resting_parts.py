"""Parts the training step never runs but sampling does (`family.resting_parts()`: Wan 2.2's expert
that does not train). They stay where they loaded (the temp device) for the whole run, so they cost
the train device nothing while training; while samples are made each is streamed onto the train
device block by block by a LayerOffloadConductor parking all of its blocks (its other layers come
over whole), and afterwards everything goes back, so a sample needs only that part's non-block
layers and a window of its blocks beside what training holds."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from modules.offload.conductor import LayerOffloadConductor

if TYPE_CHECKING:
    from modules.trainer.generic_trainer import GenericTrainer


def resting_parts(trainer: GenericTrainer) -> tuple[str, ...]:
    return tuple(trainer.family.resting_parts())


@contextlib.contextmanager
def resting_parts_woken(trainer: GenericTrainer):
    """Each resting part runnable on the train device until the block ends, then back on the temp device."""
    temp = torch.device(trainer.config.temp_device)
    woken: list[tuple[torch.nn.Module, LayerOffloadConductor]] = []
    try:
        for name in resting_parts(trainer):
            module = trainer.family.parts[name]
            conductor = LayerOffloadConductor(trainer.family.checkpoint_blocks(name), 1.0, trainer.device, temp, name,
                                              trainer.config.model.parts[name].offload_prefetch)
            conductor.start()
            woken.append((module, conductor))
            owned = conductor.owned_modules()
            for child in module.modules():
                if id(child) not in owned:
                    child._apply(lambda t: t.to(trainer.device), recurse=False)
        yield
    finally:
        for module, conductor in woken:
            conductor.evict()
            conductor.stop()
            module.to(temp)
