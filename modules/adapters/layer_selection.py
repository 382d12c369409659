"""Which layers of a run's model get an adapter: one rule for building the adapters on the loaded
modules (adapter_set.py) and for sizing them from a checkpoint's names and shapes before anything
loads (adapter_size.py), so the disk estimate counts exactly the layers training will adapt.

The rule: the parts that train and carry adapters; in each, the Linear layers (and Conv2d where
the filter or preset allows) whose "part.module.name" a `layer_filter` regex (or else the
`layer_preset`'s) finds; of those, the ones whose output never reaches the loss (the family's
unreachable_prefixes: e.g. the last block of a text encoder read at its penultimate block) are
set aside, with the reason, instead of getting an adapter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Mapping

from torch import nn

from modules.quantization.base import is_linear

if TYPE_CHECKING:
    from modules.config.train_config import AdapterConfig, TrainConfig
    from modules.model.base import ModelFamily

LayerKind = Literal["linear", "conv"]

# 2-D weights that are embedding tables, not Linear layers (CLIP, T5, Qwen names)
_EMBEDDING = re.compile(r"(token_embedding|position_embedding|embed_tokens|relative_attention_bias|^shared)$")


@dataclass
class LayerSelection:
    chosen: list[str] = field(default_factory=list)  # module names in the part that get an adapter
    unreachable: list[str] = field(default_factory=list)  # selected, but their output never reaches the loss
    matched_filters: set[int] = field(default_factory=set)  # indices of the layer_filter regexes that found a layer


def trained_parts(config: TrainConfig, family: ModelFamily) -> list[str]:
    """The parts an adapter run trains: those set to train that carry adapters (not e.g. the VAE)."""
    return [name for name, part in config.model.parts.items() if part.train and family.spec(name).adapter_prefix]


def module_kind(module: nn.Module) -> LayerKind | None:
    # a quantized Linear is a Linear to an adapter: it reads the base through the layer's forward
    if is_linear(module):
        return "linear"
    if isinstance(module, nn.Conv2d) and module.groups == 1:
        return "conv"
    return None


def weight_kind(name: str, shape: tuple[int, ...]) -> LayerKind | None:
    """What a layer is from its weight's checkpoint shape (a grouped Conv2d cannot be told from
    its shape: it counts, which errs on the large side)."""
    if len(shape) == 2 and not _EMBEDDING.search(name):
        return "linear"
    if len(shape) == 4:
        return "conv"
    return None


def module_kinds(module: nn.Module) -> dict[str, LayerKind | None]:
    """Module name -> kind, for a loaded part."""
    return {name: module_kind(child) for name, child in module.named_modules()}


def layer_patterns(family: ModelFamily, adapter: AdapterConfig) -> tuple[list[re.Pattern], bool]:
    """The regexes a layer's "part.module.name" must match, and whether Conv2d layers may."""
    if adapter.layer_filter:
        return [re.compile(p) for p in adapter.layer_filter], True
    regexes, with_conv = family.layer_presets[adapter.layer_preset]
    return [re.compile(p) for p in regexes], with_conv


def select_layers(family: ModelFamily, part: str, kinds: Mapping[str, LayerKind | None],
                  adapter: AdapterConfig) -> LayerSelection:
    """The layers of `part` (module name -> kind, in module order) that `adapter` selects."""
    patterns, with_conv = layer_patterns(family, adapter)
    unreachable = family.unreachable_prefixes(part, list(kinds))
    selection = LayerSelection()
    for name, kind in kinds.items():
        if kind is None or (kind == "conv" and not with_conv):
            continue
        qualified = f"{part}.{name}"
        found = {i for i, p in enumerate(patterns) if p.search(qualified)}
        if not found:
            continue
        if adapter.layer_filter:
            selection.matched_filters |= found
        if unreachable and name.startswith(unreachable):
            selection.unreachable.append(name)
        else:
            selection.chosen.append(name)
    return selection
