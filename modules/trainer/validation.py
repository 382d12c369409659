"""The validation loss: the mean loss over the validation concepts at fixed noise and timesteps
(the loss options apply), with the weights samples use and no dropout, so the same weights give
the same number at every validation of every run."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from modules.trainer.loss import training_loss
from modules.util.torch_utils import autocast, dtype_of, make_generator

if TYPE_CHECKING:
    from modules.trainer.generic_trainer import GenericTrainer

# the validation draws' seed: the same noise and timesteps at every validation of every run
VALIDATION_SEED = 20_231_129


@torch.no_grad()
def validation_loss(trainer: GenericTrainer) -> float:
    family, device = trainer.family, trainer.device
    generator = make_generator(device, VALIDATION_SEED)
    trained = {part: family.parts[part].training for part in trainer.trained_parts}
    losses, batches = [], trainer.validation_set.epoch_batches(0)
    try:
        for part in trained:
            family.parts[part].eval()  # no dropout: the same number for the same weights
        with trainer.evaluation_weights(), autocast(device, dtype_of(trainer.config.train_dtype)):
            for indices in batches:
                batch = trainer.validation_set.collate(indices, device)
                out = family.predict(batch.latents, trainer.conditioning(batch), generator)
                losses.append(training_loss(out, trainer.config.loss, batch.loss_weights, batch.masks).item()
                              * len(indices))
    finally:
        for part, mode in trained.items():
            family.parts[part].train(mode)
    return sum(losses) / sum(len(b) for b in batches)
