"""Optimizers by config type. Each config type maps to one builder taking the parameter groups."""

from __future__ import annotations

from typing import Callable

import torch

from modules.config.train_config import AdamWConfig


def _adamw(config: AdamWConfig, groups: list[dict]) -> torch.optim.Optimizer:
    # foreach: one fused kernel launch per group instead of one per tensor (many small LoRA tensors)
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay, foreach=True)


_BUILDERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"adamw": _adamw}


def build_optimizer(config, groups: list[dict]) -> torch.optim.Optimizer:
    """`groups`: [{"params": [...], "lr": optional per-part lr, "name": part}]."""
    return _BUILDERS[config.type](config, groups)
