"""The LoRA adapter algorithm's config and traits (its module: modules/adapters/lora.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modules.config.adapter_configs import (AdapterConfigBase, DecompositionOptions, LowRankOptions,
                                           register_adapter_config)


class LoRAConfig(DecompositionOptions, LowRankOptions, AdapterConfigBase):
    type: Literal["lora"] = Field("lora", description="lora: low-rank up(down(x)) (with dora: DoRA).")


register_adapter_config(LoRAConfig, "modules.adapters.lora:LoRAModule", label="LoRA", dora_label="DoRA")
