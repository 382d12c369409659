"""The adapter algorithms by config name: the AdapterModule classes behind the declared
`adapter.type` union (modules/config/adapter_configs.py ADAPTERS; each built-in algorithm's config
file in modules/config/adapters/ names its module here, imported when a run builds adapters).
`register_adapter` declares an algorithm defined at runtime (a plugin, a test) from its class."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from modules.config.adapter_configs import ADAPTERS, register_adapter_config

if TYPE_CHECKING:
    from modules.adapters.base import AdapterModule
    from modules.config.adapter_configs import AdapterConfigBase

_Adapter = TypeVar("_Adapter", bound=type)


def register_adapter(cls: _Adapter, **traits) -> _Adapter:
    """Make `cls` an adapter algorithm, `adapter.type: cls.algorithm` (its `config_class` is declared
    with it as the implementation)."""
    config = getattr(cls, "config_class", None)
    tag = config.model_fields["type"].default if config is not None else None
    if not cls.algorithm or tag != cls.algorithm:
        raise TypeError(f"{cls.__name__}: an adapter algorithm needs `algorithm` and a `config_class` whose "
                        f"type defaults to it (algorithm {cls.algorithm!r}, config type {tag!r})")
    register_adapter_config(config, cls, **traits)
    return cls


def unregister_adapter(name: str) -> None:
    """Remove a runtime-registered algorithm (a test's own)."""
    ADAPTERS.unregister(name)


def adapter_classes() -> dict[str, type[AdapterModule]]:
    """Every registered algorithm by its `adapter.type` name, the default (lora) first."""
    return {name: member.load() for name, member in ADAPTERS.members().items()}


def adapter_class(name: str) -> type[AdapterModule]:
    return ADAPTERS.member(name).load()


def create_adapter(config: AdapterConfigBase, part: str, name: str, module: nn.Module, device: torch.device,
                   dtype: torch.dtype, output_format: str = "kohya") -> AdapterModule:
    """An adapter of `config.type` for `module` (a layer of `part`), on `device` in `dtype`, unhooked;
    `output_format` resolves dora_axis 'auto'."""
    return adapter_class(config.type).from_config(config, part, name, module, device, dtype, output_format)
