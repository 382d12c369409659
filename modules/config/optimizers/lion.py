"""Lion (lion-pytorch): its config, builder and traits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modules.config.limits import MAX_LEARNING_RATE, MAX_WEIGHT_DECAY
from modules.config.optimizer_configs import Betas, OptimizerConfigBase, register_optimizer_config


class LionConfig(OptimizerConfigBase):
    """Lion (lion-pytorch): sign updates, one moment; wants ~3-10x smaller lr than AdamW."""

    type: Literal["lion"] = "lion"
    lr: float = Field(3e-5, gt=0, le=MAX_LEARNING_RATE,
        description="The learning rate (a part's own learning_rate overrides it).")
    betas: Betas = Field((0.9, 0.99), description="Decay rates of the moment estimates.")
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY, description="Decoupled weight decay.")


register_optimizer_config(LionConfig, "modules.optim.optimizers:build_lion")
