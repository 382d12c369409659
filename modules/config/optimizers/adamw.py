"""AdamW (torch): its config, builder and traits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modules.config.limits import MAX_EPSILON, MAX_LEARNING_RATE, MAX_WEIGHT_DECAY
from modules.config.optimizer_configs import Betas, OptimizerConfigBase, register_optimizer_config


class AdamWConfig(OptimizerConfigBase):
    type: Literal["adamw"] = "adamw"
    lr: float = Field(1e-4, gt=0, le=MAX_LEARNING_RATE,
        description="The learning rate (a part's own learning_rate overrides it).")
    betas: Betas = Field((0.9, 0.999), description="Decay rates of the moment estimates.")
    eps: float = Field(1e-8, gt=0, le=MAX_EPSILON, description="Added to denominators for numerical stability.")
    weight_decay: float = Field(1e-2, ge=0, le=MAX_WEIGHT_DECAY, description="Decoupled weight decay.")


register_optimizer_config(AdamWConfig, "modules.optim.optimizers:build_adamw")
