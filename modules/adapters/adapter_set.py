"""AdapterSet: the adapters of one run, chosen by layer filter over the trained parts.

Its state dict is the canonical one, keyed the way kohya/LyCORIS files are
(`lora_unet_down_blocks_0_..._to_q.lora_down.weight`), so backups, saved files and loading
another trainer's file all speak the same names.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from modules.adapters.base import AdapterModule
from modules.adapters.lora import LoRAModule
from modules.util.torch_utils import dtype_of

if TYPE_CHECKING:
    from modules.config.train_config import AdapterConfig
    from modules.model.base import ModelFamily


class AdapterSetError(ValueError):
    pass


class AdapterSet:
    def __init__(self) -> None:
        self.modules = nn.ModuleDict()
        self.part_of: dict[str, str] = {}  # adapter name -> model part

    def add(self, part: str, adapter: AdapterModule) -> None:
        self.modules[adapter.name] = adapter
        self.part_of[adapter.name] = part

    def __len__(self) -> int:
        return len(self.modules)

    def __iter__(self):
        return iter(self.modules.values())

    def hook(self) -> None:
        for adapter in self:
            adapter.hook()

    def unhook(self) -> None:
        for adapter in self:
            adapter.unhook()

    def parameters(self, part: str | None = None) -> list[nn.Parameter]:
        return [p for name, a in self.modules.items() if part in (None, self.part_of[name]) for p in a.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.modules.named_parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.modules.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], source: str = "adapter state") -> None:
        """Strict: every key must fit an adapter and every adapter tensor must be given."""
        own = self.modules.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        mismatched = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
        problems = []
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape-mismatched", mismatched)):
            if keys:
                problems.append(f"{label} keys: " + ", ".join(keys[:6]) + (f", ... ({len(keys)} in all)" if len(keys) > 6 else ""))
        if problems:
            raise AdapterSetError(f"{source} does not fit this run's adapters: " + "; ".join(problems))
        with torch.no_grad():
            self.modules.load_state_dict(state, strict=True)


def build_adapter_set(family: ModelFamily, adapter: AdapterConfig, trained_parts: list[str],
                      device: torch.device) -> AdapterSet:
    """Create adapters on `device` for the layers of `trained_parts` the filter selects, and hook them."""
    adapters = AdapterSet()
    matched_filters: set[int] = set()
    for part in trained_parts:
        for module_name, module in family.adapter_targets(part, adapter.layer_filter, adapter.layer_preset):
            qualified = f"{part}.{module_name}"
            matched_filters.update(i for i, p in enumerate(adapter.layer_filter) if re.search(p, qualified))
            adapters.add(part, LoRAModule(
                family.adapter_name(part, module_name), module, adapter.rank, adapter.alpha, adapter.dropout,
                device=device, dtype=dtype_of(adapter.dtype),
            ))
    unmatched = [f"adapter.layer_filter[{i}]: {p!r} matches no layer of the trained parts ({', '.join(trained_parts)})"
                 for i, p in enumerate(adapter.layer_filter) if i not in matched_filters]
    if unmatched:
        raise AdapterSetError("\n".join(unmatched))
    if not adapters:
        raise AdapterSetError(
            f"adapter.layer_preset: {adapter.layer_preset!r} selects no layer of the trained parts ({', '.join(trained_parts)})"
        )
    adapters.hook()
    return adapters
