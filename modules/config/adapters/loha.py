"""The LoHa adapter algorithm's config and traits (its module: modules/adapters/loha.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modules.config.adapter_configs import AdapterConfigBase, LowRankOptions, register_adapter_config


class LoHaConfig(LowRankOptions, AdapterConfigBase):
    type: Literal["loha"] = Field("loha", description="loha: a Hadamard product of two low-rank products.")


register_adapter_config(LoHaConfig, "modules.adapters.loha:LoHaModule", label="LoHa")
