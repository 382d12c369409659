"""The adapter method: train `config.adapter` (LoRA, LoHa, LoKr, OFT, DoRA) on the trained parts,
the base weights frozen (modules/methods/adapter.py)."""

from __future__ import annotations

from typing import Literal

from modules.config.method_configs import MethodConfigBase, register_method_config


class AdapterMethodConfig(MethodConfigBase):
    """Train an adapter (LoRA, LoHa, LoKr, OFT, DoRA: `adapter`) on the trained parts; the base
    weights stay frozen."""

    type: Literal["adapter"] = "adapter"


register_method_config(AdapterMethodConfig, "modules.methods.adapter:AdapterMethod", uses_adapter=True)
