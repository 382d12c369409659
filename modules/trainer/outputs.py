"""What a run leaves behind, on the schedule or when asked (the trainer's boundary, a command): the
samples, the validation loss, backups and saved files. With several processes every rank joins what
gathers across them (a sharded model's forward passes and weights, the random states of a backup),
and rank 0 writes."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from modules.config.sampling_config import SamplePromptConfig
from modules.methods.base import joined_state
from modules.sampling.sampler import sample_prompts
from modules.saving.backup import write_backup
from modules.trainer.sharding import whole_state_dicts
from modules.trainer.training_state import training_state
from modules.trainer.validation import validation_loss
from modules.util.torch_utils import dtype_of

if TYPE_CHECKING:
    from modules.trainer.generic_trainer import GenericTrainer


def saved_suffixes(config) -> list[str]:
    """The suffixes after output.path's stem of the files the final save writes, from the config
    alone (before the model loads): an adapter run's per the family's adapter_files (Wan 2.2's
    `-high_noise` and `-low_noise`), else the one file."""
    from modules.adapters.layer_selection import trained_parts
    from modules.config.families import get_family_class
    from modules.config.method_configs import METHODS

    if not METHODS.traits(config.method.type).uses_adapter:
        return [""]
    family = get_family_class(config.model.family)
    return [suffix for suffix, _ in family.adapter_files(trained_parts(config, family))]


def sample(trainer: GenericTrainer, prompts: list[SamplePromptConfig] | None = None,
           names: list[str] | None = None) -> list[Path]:
    """The config's enabled prompts (files named by their place in sampling.prompts), or `prompts`."""
    if prompts is None:
        chosen = [(str(i), p) for i, p in enumerate(trainer.config.sampling.prompts) if p.enabled]
        names, prompts = [n for n, _ in chosen], [p for _, p in chosen]
    if not trainer.ranks.main and not trainer.sharded:  # (sharded: every rank joins the forward passes)
        return []
    if not prompts:
        if trainer.ranks.main:
            trainer.callbacks.on_warning("sampling.prompts: no enabled prompt to sample")
        return []
    trainer.callbacks.on_status("sampling")

    def log_sample(name: str, made) -> None:
        trainer.tensorboard.add_sample(trainer.step, f"samples/{name}", made, trainer.family.video_fps)

    with trainer.offload_paused(), trainer.evaluation_weights():
        # (several processes: `stopping` is what they agreed at the boundary, so none stops alone)
        paths = sample_prompts(trainer.family, prompts, trainer.workspace / "samples", trainer.step, trainer.device,
                               names, write=trainer.ranks.main, stop=lambda: trainer.stopping, on_made=log_sample)
    for path, prompt in zip(paths, prompts):  # (the paths are the first prompts': a stop drops the rest)
        if prompt.control_images:  # what it was made from, for the gallery to show beside it
            trainer.callbacks.on_sample(str(path), control_images=list(prompt.control_images))
        else:
            trainer.callbacks.on_sample(str(path))
    return paths


def validate(trainer: GenericTrainer) -> float | None:
    """The validation loss (validation.py), logged and reported as a `validation` event."""
    if not trainer.ranks.main and not trainer.sharded:  # (sharded: every rank joins the forward passes)
        return None
    if trainer.validation_set is None:
        if trainer.ranks.main:
            trainer.callbacks.on_warning("schedule.validate_every: no concept has validation: true")
        return None
    loss = validation_loss(trainer)
    if not trainer.ranks.main:
        return None
    trainer.tensorboard.add(trainer.step, validation_loss=loss)
    trainer.callbacks.on_validation(trainer.step, loss)
    return loss


def backup(trainer: GenericTrainer) -> Path | None:
    state = training_state(trainer)  # (several processes: every rank joins the gather of random states)
    # sharded trained weights: every rank joins their gathers (sharding.py)
    weights = joined_state(trainer.methods) if trainer.ranks.main or trainer.trains_sharded else None
    if not trainer.ranks.main:
        return None
    folder = write_backup(trainer.workspace, trainer.step, weights, state,
                          json.loads(trainer.config.model_dump_json()), trainer.config.backup.rolling_count)
    trainer.callbacks.on_backup(str(folder))
    if not trainer._backed_up:  # the first backup of this process: what the saved file will lose
        trainer._backed_up = True
        for method in trainer.methods:
            for warning in method.first_backup_warnings():
                trainer.callbacks.on_warning(warning)
    return folder


def save(trainer: GenericTrainer, path: Path | None = None) -> Path | None:
    if trainer.saves_sharded:
        # the evaluation weights (EMA, schedule-free's average) go in on every rank before the
        # gather, which copies what the sharded weights hold then
        with trainer.evaluation_weights(), whole_state_dicts(trainer):
            return _save(trainer, path, swapped=True) if trainer.ranks.main else None
    return _save(trainer, path) if trainer.ranks.main else None


def _save(trainer: GenericTrainer, path: Path | None, swapped: bool = False) -> Path:
    output = trainer.config.output
    if path is None:
        target = trainer.output_path
        path = trainer.workspace / "save" / f"{target.stem}-step{trainer.step:07d}{target.suffix}"
    metadata = {"difftrainer.family": trainer.family.name, "difftrainer.method": trainer.config.method.type}
    with contextlib.nullcontext() if swapped else trainer.evaluation_weights():
        saved = [(method, file) for method in trainer.methods
                 for file in method.save(path, dtype_of(output.dtype), metadata)]
    for method, file in saved:
        consumers = method.consumers(file)  # each save proves which tools load it whole
        if consumers is None:
            trainer.callbacks.on_save(str(file))
        else:
            trainer.callbacks.on_save(str(file), consumers=consumers)
    return saved[0][1]
