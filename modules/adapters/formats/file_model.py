"""Which model an adapter file was made for, from its key names and header alone (no tensor read),
so that a LoRA of another family given as `adapter.init_from` is refused before the base model
loads rather than after (modules/trainer/init_from_family.py asks this on the meta architecture).

A family's stems here are every stem a file may use for any layer of any part that carries
adapters, in every layout the loader reads (files.layer_stems, and the original layers kohya
files of FLUX-like families stack modules under): a superset of what one run's layer selection
adapts, so a key that names none of them surely names no layer of this model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modules.adapters.formats import diffusers as peft_keys
from modules.adapters.formats.files import canonical_keys, layer_stems, unsupported_keys
from modules.adapters.layer_selection import module_kind

if TYPE_CHECKING:
    from modules.model.base import ModelFamily


def model_stems(family: ModelFamily) -> set[str]:
    """Every key stem an adapter file may use for a layer of `family`'s built parts."""
    found: set[str] = set()
    for part, module in family.parts.items():
        if not family.spec(part).adapter_prefix:
            continue  # a VAE: no file holds its adapters
        for module_name, layer in module.named_modules():
            if module_name and module_kind(layer) is not None:
                found.update(layer_stems(family, part, module_name, family.adapter_name(part, module_name)))
        found.update(layer.stem for layer in family.original_layers(part) or ())
    return found


def _tensor_names() -> tuple[str, ...]:
    return (*canonical_keys(), *peft_keys.local_keys(), *unsupported_keys())


def key_stems(key: str, names: tuple[str, ...] | None = None) -> list[str]:
    """What the key's stem may be: the key less each tensor name it ends in (`.lora_down.weight`, `.alpha`)."""
    return [key[: -len(n) - 1] for n in names or _tensor_names() if key.endswith("." + n)]


def keys_naming(keys, stems: set[str]) -> list[str]:
    """The keys whose stem is one of `stems`."""
    names = _tensor_names()
    return [key for key in keys if any(stem in stems for stem in key_stems(key, names))]


def header_family(metadata: dict[str, str], families: list[type[ModelFamily]]) -> type[ModelFamily] | None:
    """The family a file's header names: this trainer's `difftrainer.family`, else kohya's
    `ss_base_model_version` or modelspec's `modelspec.architecture` as a family declares its own
    (one that inherits the value from the family it extends does not claim it)."""
    ours = metadata.get("difftrainer.family")
    for family in families:
        if ours == family.name:
            return family
    for field, attribute in (("ss_base_model_version", "kohya_base_version"),
                             ("modelspec.architecture", "modelspec_architecture")):
        value = metadata.get(field)
        for family in families if value else ():
            declared = family.__dict__.get(attribute)
            if isinstance(declared, str) and declared == value:
                return family
    return None
