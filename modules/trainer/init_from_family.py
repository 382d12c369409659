"""Preflight: an `adapter.init_from` file of another model family than the run's, refused before
the base model loads (the loader would refuse it only after minutes of loading), naming the file
and the family it belongs to.

The run's architecture is built on the meta device (modules/plan/architecture.py: the configs
only, no weight read) and the file's key names (its safetensors header) are matched against every
stem a file may use for its layers (modules/adapters/formats/file_model.py). A file none of whose
keys names a layer of this model is refused; which family it is comes from its header, else from
the released architecture of the other family whose layers most of its keys name. Only the
families whose stem patterns (modules/adapters/formats/key_patterns.py) promise more keys than the
best count so far are built for it: for a FLUX.1 LoRA, FLUX.1 alone (~2 s for the naming, was ~11 s).
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

from modules.adapters.formats.file_model import header_family, key_stems, keys_naming, model_stems
from modules.adapters.formats.key_patterns import family_key_patterns, stem_pattern
from modules.config.families import family_names, get_family_class
from modules.config.train_config import TrainConfig
from modules.loading.diffusers_folder import ModelLoadError


def init_from_family_problem(config: TrainConfig) -> str | None:
    """`adapter.init_from: ...` when the file names no layer of the run's model, else None (also
    where the file or the model cannot be read: the load names that)."""
    path = Path(config.adapter.init_from)
    try:
        with safe_open(str(path), "pt") as file:
            keys, metadata = list(file.keys()), file.metadata() or {}
    except (SafetensorError, OSError):
        return None
    own = built_on_meta(config)
    if own is None or not keys or keys_naming(keys, model_stems(own)):
        return None
    families = [get_family_class(name) for name in family_names()]
    belongs = header_family(metadata, families)
    if belongs is not None and belongs.name != own.name:
        why = "its header says so"
    else:
        belongs, why = _family_by_keys(keys, [f for f in families if f.name != own.name])
    whose = (f"it is an adapter of {belongs.label} (model.family {belongs.name!r}: {why})" if belongs is not None
             else "it is an adapter of no model family this trainer knows")
    return (f"adapter.init_from: {path.name}: none of its {len(keys)} keys names a layer of {own.label} "
            f"(e.g. {keys[0]}); {whose}, and this run trains model.family {own.name!r}")


def built_on_meta(config: TrainConfig):
    """The family of `config` built on meta, dense (a released architecture where model.base is
    empty); None where its configs do not build."""
    from modules.plan.architecture import build_architecture

    modes = {spec.name: "bfloat16" for spec in get_family_class(config.model.family).part_specs}
    try:
        return build_architecture(config, modes).family
    except (ModelLoadError, OSError, ValueError):
        return None


def _family_by_keys(keys: list[str], families) -> tuple[object | None, str]:
    """The family (and why) whose released layers most of the keys name; ties go to the first
    declared (FLUX.1 before Kontext, which shares its layers). A family names at most the keys with
    one of its stem patterns, so the families are built most promising first, and one that cannot
    beat the best count so far is not built (a family the patterns file lacks: every key may)."""
    known = family_key_patterns()
    key_patterns = [{stem_pattern(stem) for stem in key_stems(key)} for key in keys]

    def at_most(family) -> int:
        patterns = known.get(family.name)
        return len(keys) if patterns is None else sum(1 for each in key_patterns if not patterns.isdisjoint(each))

    bounds = sorted(((at_most(family), index, family) for index, family in enumerate(families)),
                    key=lambda bound: (-bound[0], bound[1]))
    best, named, best_index = None, 0, len(families)
    for bound, index, family in bounds:
        if bound < named or bound == 0:
            break  # the rest are bounded lower still
        if bound == named and index > best_index:
            continue  # at best a tie, which the earlier declared family keeps
        built = built_on_meta(TrainConfig.model_validate({"model": {"family": family.name}}))
        count = len(keys_naming(keys, model_stems(built))) if built is not None else 0
        if count > named or (count == named and count and index < best_index):
            best, named, best_index = family, count, index
    return best, (f"{named} of its keys name that model's layers" if best is not None else "")
