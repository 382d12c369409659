"""Adafactor (torch): its config, builder and traits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modules.config.limits import MAX_LEARNING_RATE, MAX_WEIGHT_DECAY
from modules.config.optimizer_configs import Epsilon, OptimizerConfigBase, register_optimizer_config


class AdafactorConfig(OptimizerConfigBase):
    """torch.optim.Adafactor: factored second moments, no first moment (very little state)."""

    type: Literal["adafactor"] = "adafactor"
    lr: float = Field(1e-2, gt=0, le=MAX_LEARNING_RATE,
        description="The learning rate (a part's own learning_rate overrides it).")
    beta2_decay: float = Field(-0.8, ge=-10, lt=0, description="Exponent of the second-moment decay schedule.")
    eps: tuple[Epsilon | None, Epsilon] = Field((None, 1e-3), description="Regularisation of the squared gradient and "
                                            "of the update's RMS; None: the dtype's own epsilon.")
    d: float = Field(1.0, gt=0, le=1000, description="Clipping threshold of the update's RMS.")
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY, description="Decoupled weight decay.")


register_optimizer_config(AdafactorConfig, "modules.optim.optimizers:build_adafactor",
                          unshardable=("its factored second moment is per whole weight (row and column means), "
                                       "which torch's Adafactor cannot compute on the split weights (an in-place "
                                       "step DTensor refuses)"))
