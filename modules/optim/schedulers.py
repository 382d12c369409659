"""Learning-rate schedules as multipliers of the base lr, per optimizer step."""

from __future__ import annotations

import math

import torch

from modules.config.train_config import LrSchedulerConfig


def lr_factor(config: LrSchedulerConfig, step: int, total_steps: int) -> float:
    """Multiplier for optimizer step `step` (0-based). Warmup ramps from 1/(warmup+1), never
    from zero, so the first step already moves the weights."""
    warmup = config.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if config.type == "constant":
        return 1.0
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    if config.type == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def build_scheduler(config: LrSchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(config, step, total_steps))
