"""A run's state beyond the adapter weights: what a backup holds (optimizer, scheduler, loss
scaler, random streams, position in the data, EMA) and putting it back on --resume, where this
run's changed hyperparameters apply (modules/trainer/resume.py says which changes are allowed)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from modules.config.errors import ConfigError
from modules.errors import UserError
from modules.methods.base import split_state
from modules.optim.optimizers import build_optimizer
from modules.saving.backup import damaged, newest_backup, read_backup, read_backup_config
from modules.saving.output_target import RECORD_NAME
from modules.trainer.resume import (
    apply_current_hyperparameters,
    backup_config_problem,
    check_resume_compatible,
    describe_changes,
    follow_current_schedule,
)
from modules.trainer.sharding import full_optimizer_state, reshard_optimizer_state_

if TYPE_CHECKING:
    from modules.trainer.generic_trainer import GenericTrainer


def _random_states(trainer: GenericTrainer) -> dict:
    return {
        "generator": trainer.generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(trainer.device) if trainer.device.type == "cuda" else None,
    }


def training_state(trainer: GenericTrainer) -> dict:
    """Rank 0's random states at the top level (what a one-process run reads), and with several
    processes every rank's under "ranks" (a collective: all ranks call this together)."""
    ranks = trainer.ranks.gather(_random_states(trainer)) if trainer.ranks.active else None
    return {
        "ranks": ranks,
        "optimizer": full_optimizer_state(trainer.optimizer),  # (sharded weights' state gathered whole)
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "generator": trainer.generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(trainer.device) if trainer.device.type == "cuda" else None,
        "step": trainer.step,
        "epoch": trainer.epoch,
        "batch_in_epoch": trainer.batch_in_epoch,
        "ema": trainer.ema.state_dict() if trainer.ema is not None else None,
    }


# what training_state() writes and restore_training_state() needs, by type ("ranks", "scaler",
# "cuda_rng" and "ema" may be None or absent)
_STATE_LAYOUT = {"optimizer": dict, "scheduler": dict, "generator": torch.Tensor, "torch_rng": torch.Tensor,
                 "step": int, "epoch": int, "batch_in_epoch": int}


def _state_problem(state: dict) -> str | None:
    missing = [key for key in _STATE_LAYOUT if key not in state]
    if missing:
        return f"lacks {', '.join(missing)}"
    for key, kind in _STATE_LAYOUT.items():
        if not isinstance(state[key], kind) or kind is int and (isinstance(state[key], bool) or state[key] < 0):
            wanted = "a whole number >= 0" if kind is int else kind.__name__
            return f"holds {type(state[key]).__name__} as {key!r}, not {wanted}"
    ranks = state.get("ranks") or []
    if not (isinstance(ranks, list) and all(isinstance(r, dict) and isinstance(r.get("generator"), torch.Tensor)
                                            and isinstance(r.get("torch_rng"), torch.Tensor) for r in ranks)):
        return "holds 'ranks' that are not each rank's random states"
    return None


def check_resume_early(trainer: GenericTrainer) -> None:
    """A change the backup cannot follow, or a backup that is incomplete or whose config is damaged,
    is refused before the (slow) model load; so is a resume of a workspace whose run finished without
    leaving a backup: starting again from step 0 would retrain (and resample) all of it, which is not
    what a resume asks for (kohya's --resume refuses a missing state too). A workspace no run has
    finished in starts from step 0 with a warning."""
    folder = newest_backup(trainer.workspace)
    if folder is not None:
        backup_config = read_backup_config(folder)
        problem = backup_config_problem(backup_config)
        if problem:
            raise damaged(folder, f"{folder / 'config.json'} is not a config this trainer wrote ({problem})")
        check_resume_compatible(backup_config, trainer.config, folder)
    elif (trainer.workspace / RECORD_NAME).is_file():
        raise UserError(f"the run in {trainer.workspace} finished and left no backup in "
                        f"{trainer.workspace / 'backup'} to continue from (schedule.backup_every 0 writes one "
                        "only when a run is stopped); leave out --resume to train again from step 0, or give "
                        "another workspace_dir", field="backup.resume")


def load_resume_state(trainer: GenericTrainer) -> dict | None:
    """The newest backup's trained weights loaded into the trainer's methods; its training state
    returned for `restore_training_state` once the scheduler exists. (Compatibility was checked
    before the model load, by check_resume_early.)"""
    folder = newest_backup(trainer.workspace)
    if folder is None:
        trainer.callbacks.on_warning(f"backup.resume: no backup in {trainer.workspace / 'backup'}; "
                                     "starting from step 0")
        return None
    weights, state, config_json = read_backup(folder)
    problem = _state_problem(state)
    if problem:
        raise damaged(folder, f"{folder / 'state.pt'} is not a training state this trainer wrote (it {problem})")
    for method, own in zip(trainer.methods, split_state(trainer.methods, weights)):
        method.load_state_dict(own, source=str(folder / "adapter.safetensors"))
    trainer.callbacks.on_status(f"resuming from {folder}")
    changes = describe_changes(config_json, trainer.config)
    if changes:
        trainer.callbacks.on_warning(f"resume: changed since the backup (this run's values apply from step "
                                     f"{state['step'] + 1}): " + "; ".join(changes))
    trainer.backup_config = config_json
    trainer.resume_folder = folder
    return state


@contextmanager
def _fitting(trainer: GenericTrainer, what: str) -> Iterator[None]:
    """A part of state.pt that its loader refuses (a damaged or foreign file) named with the way out."""
    try:
        yield
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as error:
        if isinstance(error, torch.OutOfMemoryError):
            raise
        folder = trainer.resume_folder
        raise damaged(folder, f"{folder / 'state.pt'}: its {what} does not fit this run "
                              f"({type(error).__name__}: {error})") from None


def restore_training_state(trainer: GenericTrainer, state: dict) -> None:
    # load_state_dict brings back the backup's hyperparameters (lr, betas, ...) with the state;
    # the ones this run's config changed are put back, and the schedule follows this run's config
    optimizer = trainer.optimizer
    current_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    with _fitting(trainer, "optimizer state"):
        optimizer.load_state_dict(state["optimizer"])
    reshard_optimizer_state_(optimizer)  # a sharded weight's state back to this rank's slice
    apply_current_hyperparameters(optimizer, current_groups, _backup_groups(trainer))
    with _fitting(trainer, "LR scheduler state"):
        trainer.scheduler.load_state_dict(state["scheduler"])
        follow_current_schedule(trainer.scheduler)
    if state.get("scaler"):
        with _fitting(trainer, "loss scaler state"):
            trainer.scaler.load_state_dict(state["scaler"])
    # this rank's own states where the backup has them (a run of as many processes), else rank 0's
    own = state.get("ranks") or []
    randoms = own[trainer.ranks.rank] if trainer.ranks.rank < len(own) else state
    with _fitting(trainer, "random state"):
        trainer.generator.set_state(randoms["generator"])
        torch.set_rng_state(randoms["torch_rng"])
        if trainer.device.type == "cuda" and randoms.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(randoms["cuda_rng"], trainer.device)
    trainer.step, trainer.epoch, trainer.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
    if trainer.ema is not None:
        if state.get("ema") is None:
            trainer.callbacks.on_warning("ema.enabled: the backup has no EMA; the average starts from the "
                                         "resumed weights")
        else:
            with _fitting(trainer, "EMA state"):
                trainer.ema.load_state_dict(state["ema"])


def _backup_groups(trainer: GenericTrainer) -> list[dict] | None:
    """The parameter groups a fresh optimizer of the backup's config has: what differs from this
    run's are the hyperparameters the user changed (the rest of a loaded group is the optimizer's
    own state, e.g. Prodigy's d, and stays as loaded). None where the backup's config no longer loads."""
    from modules.config.loading import build_config

    try:
        old = build_config([trainer.backup_config])
    except ConfigError:  # a backup this trainer no longer reads: every hyperparameter of this run applies
        return None
    optimizer = build_optimizer(old.optimizer, trainer._param_groups(old))
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
