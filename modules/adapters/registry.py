"""The adapter algorithms by config name, built from the classes: every module of this package
that defines an AdapterModule subclass marked `@register_adapter` adds it on import, so a new
algorithm is one new file here. `register_adapter` also works at runtime (a plugin, a test): the
algorithm's config then joins the `adapter.type` union of TrainConfig."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from modules.adapters.base import AdapterModule
    from modules.config.adapter_configs import AdapterConfigBase

_CLASSES: dict[str, type[AdapterModule]] = {}
_Adapter = TypeVar("_Adapter", bound=type)


def register_adapter(cls: _Adapter) -> _Adapter:
    """Make `cls` an adapter algorithm, `adapter.type: cls.algorithm` (a class decorator)."""
    name = cls.algorithm
    config = getattr(cls, "config_class", None)
    tag = config.model_fields["type"].default if config is not None else None
    if not name or tag != name:
        raise TypeError(f"{cls.__name__}: an adapter algorithm needs `algorithm` and a `config_class` whose "
                        f"type defaults to it (algorithm {name!r}, config type {tag!r})")
    if _CLASSES.get(name, cls) is not cls:
        raise TypeError(f"{cls.__name__}: adapter type {name!r} is taken by {_CLASSES[name].__name__}")
    _CLASSES[name] = cls
    _rebuild_config_schema()
    return cls


def unregister_adapter(name: str) -> None:
    """Remove a runtime-registered algorithm (a test's own)."""
    _CLASSES.pop(name, None)
    _rebuild_config_schema()


def _rebuild_config_schema() -> None:
    """The config's union is built from this registry when the schema is; rebuild it once it was
    built (while the built-in files are being found it is not yet, and is built later)."""
    from modules.config import adapter_configs

    if adapter_configs.union_built():
        from modules.config.train_config import TrainConfig

        TrainConfig.model_rebuild(force=True)


_NOT_ALGORITHMS = {"registry", "base", "adapter_set", "weight_decompose"}
_found = False


def _find_builtin_algorithms() -> None:
    """Import every module of this package once (each registers its algorithm)."""
    global _found
    if _found:
        return
    _found = True
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if not module.ispkg and module.name not in _NOT_ALGORITHMS:
            importlib.import_module(f"{__package__}.{module.name}")


def adapter_classes() -> dict[str, type[AdapterModule]]:
    """Every registered algorithm by its `adapter.type` name, the default (lora) first."""
    from modules.config.adapter_configs import DEFAULT_ADAPTER_TYPE

    _find_builtin_algorithms()
    return dict(sorted(_CLASSES.items(), key=lambda item: item[0] != DEFAULT_ADAPTER_TYPE))


def adapter_class(name: str) -> type[AdapterModule]:
    classes = adapter_classes()
    if name not in classes:
        raise ValueError(f"adapter.type: unknown type {name!r} (known: {', '.join(classes)})")
    return classes[name]


def create_adapter(config: AdapterConfigBase, part: str, name: str, module: nn.Module, device: torch.device,
                   dtype: torch.dtype, output_format: str = "kohya") -> AdapterModule:
    """An adapter of `config.type` for `module` (a layer of `part`), on `device` in `dtype`, unhooked;
    `output_format` resolves dora_axis 'auto'."""
    return adapter_class(config.type).from_config(config, part, name, module, device, dtype, output_format)
