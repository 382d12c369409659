"""The optimizers' builders: one per `optimizer.type`, taking the parameter groups (each type's file
in modules/config/optimizers/ names its builder here).

Each comes from the package that maintains it (bitsandbytes, prodigyopt, schedulefree,
lion-pytorch, came-pytorch; Adafactor from torch itself), imported only when chosen.
"""

from __future__ import annotations

import torch

from modules.config.optimizer_configs import OPTIMIZERS
from modules.config.optimizers.adafactor import AdafactorConfig
from modules.config.optimizers.adamw import AdamWConfig
from modules.config.optimizers.adamw_8bit import AdamW8bitConfig
from modules.config.optimizers.came import CAMEConfig
from modules.config.optimizers.lion import LionConfig
from modules.config.optimizers.prodigy import ProdigyConfig
from modules.config.optimizers.schedule_free_adamw import ScheduleFreeAdamWConfig


def build_adamw(config: AdamWConfig, groups: list[dict]) -> torch.optim.Optimizer:
    # foreach: one fused kernel launch per group instead of one per tensor (many small LoRA tensors)
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay, foreach=True)


def build_adamw_8bit(config: AdamW8bitConfig, groups: list[dict]) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                               weight_decay=config.weight_decay)


def build_adafactor(config: AdafactorConfig, groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(groups, lr=config.lr, beta2_decay=config.beta2_decay, eps=config.eps,
                                 d=config.d, weight_decay=config.weight_decay)


def build_prodigy(config: ProdigyConfig, groups: list[dict]) -> torch.optim.Optimizer:
    from prodigyopt import Prodigy

    return Prodigy(groups, lr=config.lr, betas=config.betas, beta3=config.beta3, eps=config.eps,
                   weight_decay=config.weight_decay, decouple=config.decouple,
                   use_bias_correction=config.use_bias_correction, safeguard_warmup=config.safeguard_warmup,
                   d_coef=config.d_coef, d0=config.d0)


def build_schedule_free_adamw(config: ScheduleFreeAdamWConfig, groups: list[dict]) -> torch.optim.Optimizer:
    from schedulefree import AdamWScheduleFree

    return AdamWScheduleFree(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay, warmup_steps=config.warmup_steps)


def build_lion(config: LionConfig, groups: list[dict]) -> torch.optim.Optimizer:
    from lion_pytorch import Lion

    return Lion(groups, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def build_came(config: CAMEConfig, groups: list[dict]) -> torch.optim.Optimizer:
    from came_pytorch import CAME

    return CAME(groups, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)


def build_optimizer(config, groups: list[dict]) -> torch.optim.Optimizer:
    """`groups`: [{"params": [...], "lr": optional per-part lr, "name": part}]."""
    optimizer = OPTIMIZERS.member(config.type).load()(config, groups)
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
