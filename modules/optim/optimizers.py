"""Optimizers by config type: one builder per type, taking the parameter groups.

Each comes from the package that maintains it (bitsandbytes, prodigyopt, schedulefree,
lion-pytorch, came-pytorch; Adafactor from torch itself), imported only when chosen.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from modules.config import train_config as tc


def _adamw(config: tc.AdamWConfig, groups: list[dict]) -> torch.optim.Optimizer:
    # foreach: one fused kernel launch per group instead of one per tensor (many small LoRA tensors)
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay, foreach=True)


def _adamw_8bit(config: tc.AdamW8bitConfig, groups: list[dict]) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                               weight_decay=config.weight_decay)


def _adafactor(config: tc.AdafactorConfig, groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(groups, lr=config.lr, beta2_decay=config.beta2_decay, eps=config.eps,
                                 d=config.d, weight_decay=config.weight_decay)


def _prodigy(config: tc.ProdigyConfig, groups: list[dict]) -> torch.optim.Optimizer:
    from prodigyopt import Prodigy

    return Prodigy(groups, lr=config.lr, betas=config.betas, beta3=config.beta3, eps=config.eps,
                   weight_decay=config.weight_decay, decouple=config.decouple,
                   use_bias_correction=config.use_bias_correction, safeguard_warmup=config.safeguard_warmup,
                   d_coef=config.d_coef, d0=config.d0)


def _schedule_free_adamw(config: tc.ScheduleFreeAdamWConfig, groups: list[dict]) -> torch.optim.Optimizer:
    from schedulefree import AdamWScheduleFree

    return AdamWScheduleFree(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay, warmup_steps=config.warmup_steps)


def _lion(config: tc.LionConfig, groups: list[dict]) -> torch.optim.Optimizer:
    from lion_pytorch import Lion

    return Lion(groups, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def _came(config: tc.CAMEConfig, groups: list[dict]) -> torch.optim.Optimizer:
    from came_pytorch import CAME

    return CAME(groups, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)


_BUILDERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": _adamw, "adamw_8bit": _adamw_8bit, "adafactor": _adafactor, "prodigy": _prodigy,
    "schedule_free_adamw": _schedule_free_adamw, "lion": _lion, "came": _came,
}


def build_optimizer(config, groups: list[dict]) -> torch.optim.Optimizer:
    """`groups`: [{"params": [...], "lr": optional per-part lr, "name": part}]."""
    optimizer = _BUILDERS[config.type](config, groups)
    if hasattr(optimizer, "train"):  # schedule-free: parameters hold the training point from here on
        optimizer.train()
    return optimizer


def evaluation_weights(optimizer: torch.optim.Optimizer):
    """Context: the weights to sample and save with. Schedule-free optimizers train at one point
    and evaluate at an average; their `eval()`/`train()` switch the parameters between the two."""
    import contextlib

    @contextlib.contextmanager
    def switched():
        if hasattr(optimizer, "eval") and hasattr(optimizer, "train"):
            optimizer.eval()
            try:
                yield
            finally:
                optimizer.train()
        else:
            yield

    return switched()
