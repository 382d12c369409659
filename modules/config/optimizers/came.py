"""CAME (came-pytorch): its config, builder and traits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modules.config.limits import MAX_LEARNING_RATE, MAX_WEIGHT_DECAY
from modules.config.optimizer_configs import Beta, Epsilon, OptimizerConfigBase, register_optimizer_config


class CAMEConfig(OptimizerConfigBase):
    """CAME (came-pytorch): confidence-guided, factored, memory-light."""

    type: Literal["came"] = "came"
    lr: float = Field(1e-4, gt=0, le=MAX_LEARNING_RATE,
        description="The learning rate (a part's own learning_rate overrides it).")
    betas: tuple[Beta, Beta, Beta] = Field((0.9, 0.999, 0.9999), description="Decay rates of the moment "
                                              "estimates.")
    eps: tuple[Epsilon, Epsilon] = Field((1e-30, 1e-16), description="Added to denominators for numerical stability.")
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY, description="Decoupled weight decay.")


register_optimizer_config(CAMEConfig, "modules.optim.optimizers:build_came",
                          unshardable=("its factored moments are per whole weight, and CAME mixes them with plain "
                                       "tensors a split weight cannot take"))
