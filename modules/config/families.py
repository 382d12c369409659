"""Model families by name. The only place the generic code learns which families exist: the
built-in ones are imported on first use (so listing names stays cheap); `register_family` adds
one at runtime (a plugin, a test's toy family) without editing this file."""

from __future__ import annotations

import importlib

# a family is a subclass of modules.model.base.ModelFamily; not imported here, even for typing:
# config sits below model (tests/test_import_layers.py)
ModelFamily = type

# name -> (module, class) for the built-in families, or the class itself once registered at runtime
_FAMILIES: dict[str, tuple[str, str] | type[ModelFamily]] = {
    "sd15": ("modules.model.sd15", "SD15Family"),
    "sdxl": ("modules.model.sdxl", "SDXLFamily"),
    "flux": ("modules.model.flux", "FluxFamily"),
    "z_image": ("modules.model.z_image", "ZImageFamily"),
    "sd3": ("modules.model.sd3", "SD3Family"),
    "chroma": ("modules.model.chroma", "ChromaFamily"),
    "flux2": ("modules.model.flux2", "Flux2Family"),
    "qwen_image": ("modules.model.qwen_image", "QwenImageFamily"),
    "wan": ("modules.model.wan", "WanFamily"),
}


def family_names() -> list[str]:
    return list(_FAMILIES)


def get_family_class(name: str) -> type[ModelFamily]:
    entry = _FAMILIES[name]
    if isinstance(entry, type):
        return entry
    module_name, class_name = entry
    return getattr(importlib.import_module(module_name), class_name)


def register_family(family_class: type[ModelFamily]) -> None:
    """Make `family_class` trainable under its `name` (config model.family, the GUI's list)."""
    name = family_class.name
    if name in _FAMILIES and get_family_class(name) is not family_class:
        raise ValueError(f"model family {name!r} is already registered ({get_family_class(name).__name__})")
    _FAMILIES[name] = family_class


def unregister_family(name: str) -> None:
    """Remove a family added by `register_family` (the built-in ones stay)."""
    if not isinstance(_FAMILIES.get(name), type):
        raise ValueError(f"model family {name!r} was not registered at runtime")
    del _FAMILIES[name]
