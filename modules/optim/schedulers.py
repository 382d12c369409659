"""Learning-rate schedules as multipliers of the base lr, per optimizer step."""

from __future__ import annotations

import math

import torch

from modules.config.train_config import LrSchedulerConfig


def lr_factor(config: LrSchedulerConfig, step: int, total_steps: int) -> float:
    """Multiplier for optimizer step `step` (0-based). Warmup ramps from 1/(warmup+1), never
    from zero, so the first step already moves the weights; decays never go below min_factor."""
    warmup = config.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if config.type == "constant":
        return 1.0
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    if config.type == "linear":
        decay = 1.0 - progress
    elif config.type == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif config.type == "cosine_with_restarts":
        # each of `cycles` cycles decays from 1 to 0 and restarts; the last one ends at 0
        within = (progress * config.cycles) % 1.0 if progress < 1.0 else 1.0
        decay = 0.5 * (1.0 + math.cos(math.pi * within))
    else:  # polynomial
        decay = (1.0 - progress) ** config.power
    return config.min_factor + (1.0 - config.min_factor) * decay


def warmup_note(config: LrSchedulerConfig, total_steps: int) -> str | None:
    """A warning when warmup outlasts the run: the learning rate then never reaches the one configured."""
    if config.warmup_steps <= total_steps or total_steps <= 0:
        return None
    last = lr_factor(config, total_steps - 1, total_steps)
    return (f"lr_scheduler.warmup_steps: {config.warmup_steps} is longer than the whole run ({total_steps} step(s)): "
            f"the learning rate never reaches optimizer.lr (it ends at {last:.0%} of it); lower warmup_steps")


def build_scheduler(config: LrSchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(config, step, total_steps))
