"""Model families by name. The only place the generic code learns which families exist: each
built-in family declares itself in one torch-free file of this package (its name, parts, layer
presets: modules/config/family_declaration.py), listed below in the GUI's order; its
implementation is imported only when a model is built. `register_family` adds one at runtime (a
plugin, a test's toy family) without editing this file."""

from __future__ import annotations

import importlib

from modules.config.family_declaration import FamilyDeclaration

# a family is a subclass of modules.model.base.ModelFamily; not imported here, even for typing:
# config sits below model (tests/test_import_layers.py)
ModelFamily = type

# the built-in declarations, one module each in this package
BUILTIN = ("sd15", "sdxl", "flux", "flux_kontext", "z_image", "sd3", "chroma", "flux2", "qwen_image", "qwen_image_edit",
           "qwen_image_edit_plus", "wan", "wan_i2v", "wan22", "wan22_i2v", "wan22_ti2v",
           "krea2", "anima", "fibo2", "fibo_edit")

# name -> its declaration module (built in, imported on first use), or the class registered at runtime
_FAMILIES: dict[str, str | type[ModelFamily]] = {name: f"{__name__}.{name}" for name in BUILTIN}


def family_names() -> list[str]:
    return list(_FAMILIES)


def get_family_declaration(name: str) -> FamilyDeclaration:
    """What the config and the GUI know of family `name`, without importing its model code."""
    entry = _FAMILIES[name]
    if isinstance(entry, type):
        return FamilyDeclaration.of_class(entry)
    return importlib.import_module(entry).DECLARATION


def get_family_class(name: str) -> type[ModelFamily]:
    entry = _FAMILIES[name]
    if isinstance(entry, type):
        return entry
    module_name, class_name = get_family_declaration(name).implementation.split(":")
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
