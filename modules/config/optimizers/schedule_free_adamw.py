"""Schedule-free AdamW (schedulefree): its config, builder and traits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modules.config.limits import MAX_EPSILON, MAX_LEARNING_RATE, MAX_STEPS, MAX_WEIGHT_DECAY
from modules.config.optimizer_configs import Betas, OptimizerConfigBase, register_optimizer_config


class ScheduleFreeAdamWConfig(OptimizerConfigBase):
    """Schedule-free AdamW (schedulefree): no LR schedule needed (use lr_scheduler constant); samples
    and saves use its averaged weights."""

    type: Literal["schedule_free_adamw"] = "schedule_free_adamw"
    lr: float = Field(2.5e-3, gt=0, le=MAX_LEARNING_RATE,
        description="The learning rate (a part's own learning_rate overrides it).")
    betas: Betas = Field((0.9, 0.999), description="Decay rates of the moment estimates.")
    eps: float = Field(1e-8, gt=0, le=MAX_EPSILON, description="Added to denominators for numerical stability.")
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY, description="Decoupled weight decay.")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Steps of the optimizer's own warmup.")


register_optimizer_config(ScheduleFreeAdamWConfig, "modules.optim.optimizers:build_schedule_free_adamw",
                          needs_whole_step=("schedule-free AdamW counts and weights its average once per whole step"))
