"""The real architecture of a config's model on the meta device: every part built from its
config.json (no weight read), its Linear layers replaced by the weight mode's own empty layers
(on meta too), so each tensor has the shape and dtype it will have when trained.

The family builds its parts itself (`load()` with every part a skeleton part), so what is planned
is what loads: the same classes, folders, single-file configs and skip lists. Families load every
part before any tokenizer or scheduler, so a folder without those (resources/model_configs) still
yields every part; what fails after the parts is not needed here.

`model.base` empty: the family's released architecture from its `released_config_folder()`
(resources/model_configs/<family>/, or the folder of the model it shares its parts with: FLUX.1's for
Kontext; what the presets are sized for). `variant` (a family of several models, e.g. FLUX.2 "dev") picks
the config folders `<subfolder>_<variant>` where they exist there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modules.config.families import get_family_class
from modules.config.train_config import TrainConfig
from modules.loading.diffusers_folder import ModelLoadError
from modules.quantization.half_storage import stored_dtype
from modules.quantization.replace import is_quantized_mode, new_quantized_layer, plan_layers
from modules.quantization.skip_rules import FAMILY_SKIP_ATTRIBUTE, keeps_float32

META = torch.device("meta")


@dataclass
class PlannedModel:
    family: object  # a ModelFamily whose parts sit on the meta device, quantized as planned
    config: TrainConfig  # the config planned (model.base filled in for a released architecture)
    released: bool  # built from resources/model_configs, not from model.base


def released_config(config: TrainConfig, variant: str | None = None) -> TrainConfig:
    """`config` with model.base pointing at the family's shipped configs (and a variant's folders
    as part paths), for planning a family's released architecture without its weights."""
    family_class = get_family_class(config.model.family)
    folder = family_class.released_config_folder()
    parts = {}
    for spec in family_class.part_specs:
        candidate = folder / f"{spec.subfolder}_{variant}" if variant else None
        if candidate is not None and (candidate / "config.json").is_file():
            parts[spec.name] = config.model.parts[spec.name].model_copy(update={"path": str(candidate)})
    model = config.model.model_copy(update={"base": str(folder), "parts": {**config.model.parts, **parts}})
    return config.model_copy(update={"model": model})


def build_architecture(config: TrainConfig, weight_modes: dict[str, str], variant: str | None = None) -> PlannedModel:
    """Every part of `config`'s model on meta in its weight mode (`weight_modes`: part -> a concrete
    mode, "auto" resolved)."""
    released = not config.model.base
    if released:
        config = released_config(config, variant)
    family = get_family_class(config.model.family)(config, weight_modes)
    family.skeleton_parts = frozenset(spec.name for spec in family.part_specs)
    try:
        family.load()
    except (ModelLoadError, OSError, ValueError):
        # tokenizers and schedulers come after the parts; a part that did not build is named below
        pass
    missing = [spec.name for spec in family.part_specs if spec.name not in family.parts]
    if missing:
        family.load()  # raises the load's own error, naming the part and the folder
        raise ModelLoadError(f"model.base: no {', '.join(missing)} could be built from {config.model.base}")
    for part, module in family.parts.items():
        store_as_planned(module, part, family.weight_mode(part), family.compute_dtype(part),
                         config.model.parts[part], family.quantize_skip_patterns.get(part, ()))
    return PlannedModel(family, config, released)


def store_as_planned(module: nn.Module, part: str, mode: str, compute_dtype: torch.dtype, part_config,
                     family_skip: tuple[str, ...]) -> None:
    """As streamed_load does on a real load: quantized layers from the mode's factory (their
    storage on meta), every other floating tensor in the dense dtype, `_keep_in_fp32_modules` in
    float32."""
    dense = stored_dtype(mode, compute_dtype)  # (the other 16-bit float's: half_storage.py)
    if is_quantized_mode(mode):
        setattr(module, FAMILY_SKIP_ATTRIBUTE, family_skip)
        targets, _ = plan_layers(module, part, part_config.quantize_skip)
        options = part_config.layer_options().on(META)
        for name in targets:
            module.set_submodule(name, new_quantized_layer(mode, module.get_submodule(name), compute_dtype, options))
    quantized = set(targets) if is_quantized_mode(mode) else set()
    casts: dict[int, torch.Tensor] = {}  # a tensor two modules share (tied weights) stays one tensor
    for name, child in module.named_modules():
        if _within(name, quantized):
            continue
        dtype = torch.float32 if keeps_float32(module, name) else dense
        for attr, tensor in [*child.named_parameters(recurse=False), *child.named_buffers(recurse=False)]:
            if id(tensor) in casts:
                cast = casts[id(tensor)]
            elif tensor is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                cast = tensor.to(dtype)
                if attr in child._parameters:
                    cast = nn.Parameter(cast, requires_grad=False)
                casts[id(tensor)] = cast
            else:
                continue
            (child._parameters if attr in child._parameters else child._buffers)[attr] = cast
    module.requires_grad_(False)


def _within(name: str, layers: set[str]) -> bool:
    """`name` is one of `layers` or a module inside one (its dotted prefixes looked up: a part has
    thousands of modules and of quantized layers)."""
    while name:
        if name in layers:
            return True
        name = name.rpartition(".")[0]
    return False
