"""Prodigy (prodigyopt): its config, builder and traits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modules.config.limits import MAX_EPSILON, MAX_LEARNING_RATE, MAX_WEIGHT_DECAY
from modules.config.optimizer_configs import Betas, OptimizerConfigBase, register_optimizer_config


class ProdigyConfig(OptimizerConfigBase):
    """Prodigy (prodigyopt): estimates the step size itself; lr is a multiplier, 1.0 as a rule."""

    type: Literal["prodigy"] = "prodigy"
    lr: float = Field(1.0, gt=0, le=MAX_LEARNING_RATE,
        description="The learning rate (a part's own learning_rate overrides it).")
    betas: Betas = Field((0.9, 0.999), description="Decay rates of the moment estimates.")
    beta3: float | None = Field(None, ge=0, lt=1, description="None: sqrt(beta2).")
    eps: float = Field(1e-8, gt=0, le=MAX_EPSILON, description="Added to denominators for numerical stability.")
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY, description="Decoupled weight decay.")
    decouple: bool = Field(True, description="AdamW-style decoupled weight decay.")
    use_bias_correction: bool = Field(False, description="Adam bias correction of the step-size estimate.")
    safeguard_warmup: bool = Field(False, description="Keep the step-size estimate from growing too fast "
                                   "during lr warmup.")
    d_coef: float = Field(1.0, gt=0, le=1000, description="Multiplies the estimated step size.")
    d0: float = Field(1e-6, gt=0, le=1, description="Initial step-size estimate.")


register_optimizer_config(ProdigyConfig, "modules.optim.optimizers:build_prodigy",
                          unshardable=("Prodigy's step size d sums products over each whole flattened weight, and a"
                                       " weight split unevenly across the GPUs cannot be flattened"),
                          needs_whole_step=("Prodigy estimates its step size d from all parameters together"))
