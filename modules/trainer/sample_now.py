"""The prompts a user asked for from outside the run ("Sample now", the protocol's `sample`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modules.config.train_config import SamplePromptConfig
from modules.sampling.sampler import out_of_memory

if TYPE_CHECKING:
    from modules.trainer.generic_trainer import GenericTrainer


def sample_requested(trainer: GenericTrainer, prompts: list[dict]) -> None:
    """Sample each prompt; one too big for this machine is a warning, not the end of the run
    (a sharded part samples on every rank, so there it still ends the run: the other ranks would
    wait in a collective)."""
    for number, prompt in enumerate(trainer.ranks.broadcast(prompts) if trainer.sharded else prompts):
        try:
            trainer.sample([SamplePromptConfig.model_validate(prompt)], names=[f"now{number}"])
        except RuntimeError as error:
            if trainer.sharded or not out_of_memory(error):
                raise
            trainer.callbacks.on_warning(f"sample now ({prompt['width']}x{prompt['height']}, {prompt['steps']} "
                                         f"steps) ran out of memory and was skipped; training goes on: {error}")
