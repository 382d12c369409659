"""bitsandbytes' 8-bit AdamW: its config, builder and traits."""

from __future__ import annotations

from typing import Literal

from modules.config.optimizer_configs import register_optimizer_config
from modules.config.optimizers.adamw import AdamWConfig


class AdamW8bitConfig(AdamWConfig):
    """bitsandbytes' AdamW with 8-bit (blockwise quantized) moments: ~1/4 of AdamW's state memory;
    AdamW's parameters."""

    type: Literal["adamw_8bit"] = "adamw_8bit"


register_optimizer_config(AdamW8bitConfig, "modules.optim.optimizers:build_adamw_8bit",
                          unshardable=("bitsandbytes' 8-bit kernels step plain tensors only, not weights split "
                                       "across GPUs"))
