"""The adapter types by config name, and the one place a config turns into an adapter module."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from modules.adapters.base import AdapterModule
from modules.adapters.loha import LoHaModule
from modules.adapters.lokr import LoKrModule
from modules.adapters.lora import LoRAModule
from modules.adapters.oft import OFTModule

if TYPE_CHECKING:
    from modules.config.train_config import AdapterConfig

ADAPTER_CLASSES: dict[str, type[AdapterModule]] = {
    "lora": LoRAModule, "loha": LoHaModule, "lokr": LoKrModule, "oft": OFTModule,
}


def create_adapter(config: AdapterConfig, part: str, name: str, module: nn.Module, device: torch.device,
                   dtype: torch.dtype, output_format: str = "kohya") -> AdapterModule:
    """An adapter of `config.type` for `module` (a layer of `part`), on `device` in `dtype`, unhooked;
    `output_format` resolves dora_axis 'auto'."""
    rank, alpha = config.size_for(part)
    axis = config.resolved_dora_axis(output_format)
    common = {"dropout": config.dropout, "rank_dropout": config.rank_dropout,
              "module_dropout": config.module_dropout, "device": device, "dtype": dtype}
    if config.type == "lora":
        return LoRAModule(name, module, rank, alpha, dora=config.dora, dora_axis=axis, **common)
    if config.type == "loha":
        return LoHaModule(name, module, rank, alpha, **common)
    if config.type == "lokr":
        return LoKrModule(name, module, rank, alpha, factor=config.lokr_factor,
                          decompose_both=config.lokr_decompose_both, full_matrix=config.lokr_full_matrix,
                          weight_decompose=config.dora, dora_axis=axis, **common)
    if config.type == "oft":
        return OFTModule(name, module, config.oft_block_size, constraint=config.oft_constraint, **common)
    raise ValueError(f"adapter.type: unknown type {config.type!r} (known: {', '.join(ADAPTER_CLASSES)})")
