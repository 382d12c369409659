"""Model families by name. The only place the generic code learns which families exist;
each entry is imported on first use, so listing names stays cheap."""

from __future__ import annotations

import importlib

_FAMILIES = {
    "sd15": ("modules.model.sd15", "SD15Family"),
    "sdxl": ("modules.model.sdxl", "SDXLFamily"),
    "flux": ("modules.model.flux", "FluxFamily"),
    "z_image": ("modules.model.z_image", "ZImageFamily"),
}


def family_names() -> list[str]:
    return list(_FAMILIES)


def get_family_class(name: str):
    module_name, class_name = _FAMILIES[name]
    return getattr(importlib.import_module(module_name), class_name)
