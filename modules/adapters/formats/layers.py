"""Continuing from an adapter file (`adapter.init_from`) that adapts layers the run's selection
leaves out (an OFT file with `conv_out` under the `attn-mlp` preset): the run adopts them, adds
their adapters (they train too) and says so, instead of refusing the file. Only layers of the
trained parts that can carry an adapter are adopted; a key naming anything else stays the
loader's error (formats/files.py names adapter.layer_preset / layer_filter, model.parts.*.train).
Runs once the model has loaded and the selection's adapters exist, before the file is read."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from modules.adapters.adapter_set import AdapterSet
from modules.adapters.base import InertAdapter
from modules.adapters.formats.adopt import file_shapes
from modules.adapters.formats.files import layer_of_key, layer_stems, unmapped_keys
from modules.adapters.layer_selection import module_kinds, select_layers
from modules.adapters.registry import create_adapter
from modules.util.torch_utils import dtype_of

if TYPE_CHECKING:
    from modules.config.train_config import AdapterConfig
    from modules.model.base import ModelFamily


def _candidates(family: ModelFamily, config: AdapterConfig, parts: list[str],
                adapters: AdapterSet) -> dict[str, tuple[str, tuple[str, str]]]:
    """stem -> (layout, (part, module name)) for every adaptable layer without an adapter yet."""
    every_layer = config.model_copy(update={"layer_filter": ["."]})  # what any selection could choose
    taken = {(adapters.part_of[n], adapters.module_name_of[n]) for n in adapters.modules}
    lookup: dict[str, tuple[str, tuple[str, str]]] = {}
    for part in parts:
        for module_name in select_layers(family, part, module_kinds(family.parts[part]), every_layer).chosen:
            if (part, module_name) in taken:
                continue
            name = family.adapter_name(part, module_name)
            for stem, layout in layer_stems(family, part, module_name, name).items():
                lookup.setdefault(stem, (layout, (part, module_name)))
    return lookup


def adopt_file_layers(source: str | Path, adapters: AdapterSet, family: ModelFamily, config: AdapterConfig,
                      parts: list[str], device: torch.device, output_format: str = "kohya") -> str | None:
    """Add (hooked) adapters for the layers of `parts` the file adapts and `adapters` lacks; what
    was adopted, to tell the user, or None."""
    stray = unmapped_keys(file_shapes(source), adapters, family)
    if not stray:
        return None
    lookup = _candidates(family, config, parts, adapters)
    adopted: dict[tuple[str, str], None] = {}
    for key in stray:
        found = layer_of_key(key, lookup)
        if found is not None:
            adopted[lookup[found[0]][1]] = None
    added = []
    for part, module_name in adopted:
        module = dict(family.parts[part].named_modules())[module_name]
        try:
            created = create_adapter(config, part, family.adapter_name(part, module_name), module, device,
                                     dtype_of(config.dtype), output_format)
        except InertAdapter:
            continue  # it could never learn: the loader names the file's key
        created.hook()
        adapters.add(part, created, module_name)
        added.append(f"{part}.{module_name}")
    if not added:
        return None
    selection = (f"adapter.layer_filter {config.layer_filter}" if config.layer_filter
                 else f"adapter.layer_preset {config.layer_preset!r}")
    shown = ", ".join(added[:8]) + (f", ... ({len(added)} in all)" if len(added) > 8 else "")
    return (f"adapter.init_from: {Path(source).name}: adopted the file's layers that {selection} leaves out, "
            f"which train too: {shown}")
