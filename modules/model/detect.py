"""Which model family a folder or single file holds, from its small files only (no weights read).

A diffusers folder says it in model_index.json (the pipeline class; a modular pipeline's folder,
such as Anima's, in modular_model_index.json) or, without one, in its denoiser's config.json; a
component folder (config.json at its top) in that config. An
original-layout .safetensors file says it in its key names (the header). Each family declares
its own signs (`pipeline_classes`, `denoiser_config`, `single_file_signature` in its file; a file of
one part alone, such as ComfyUI's Wan VAE: `single_file_part_signatures`), so nothing here names a family. Where no family matches, diffusers' own single-file classifier
(`infer_diffusers_model_type`) or the pipeline class still names what the model is, so a caller
can say "this is an SD3 model" rather than fail later on a missing folder.

The trainer's preflight compares the result with `model.family`; the GUI can fill the family in.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from modules.config.families import family_names, get_family_class


@dataclass(frozen=True)
class DetectedModel:
    family: str | None  # a family name of modules/config/families.py; None: none of ours
    kind: str  # what the files call it: a pipeline or model class, or diffusers' model type
    part: str | None = None  # a single file holding only this part of the family's model (its VAE, ...)


def detect_family(path: str | Path) -> str | None:
    """The family of the model at `path`, or None where no family matches (or nothing can be read)."""
    detected = detect_model(path)
    return detected.family if detected else None


def detect_model(path: str | Path) -> DetectedModel | None:
    """What the model at `path` is; None where its files say nothing recognisable."""
    path = Path(path).expanduser()
    try:
        if path.is_dir():
            return _detect_folder(path)
        if path.is_file() and path.suffix == ".safetensors":
            return _detect_single_file(path)
    except (OSError, ValueError):  # unreadable or not JSON / safetensors: the loader names the problem
        return None
    return None


def _families():
    return [get_family_class(name) for name in family_names()]


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else None


def _detect_folder(folder: Path) -> DetectedModel | None:
    # a modular pipeline's folder (diffusers' ModularPipeline) names its class in modular_model_index.json
    index = _read_json(folder / "model_index.json") or _read_json(folder / "modular_model_index.json")
    if index and isinstance(index.get("_class_name"), str):
        pipeline = index["_class_name"]
        # the surest claim wins (families of one pipeline class tell themselves apart by the index's entries)
        claims = [(f.claims_model_index(index), f.name) for f in _families()]
        sure = max((claim for claim, _ in claims), default=0)
        family = next((name for claim, name in claims if claim == sure), None) if sure else None
        return DetectedModel(family, pipeline)
    # no model_index.json: the denoiser's own config, in its subfolder or at the top (a component
    # folder); the family whose signature says most about it (Wan 2.1's transformer or TI2V's 48-channel one)
    found = []
    for family in _families():
        subfolder = family.spec(family.denoiser_part).subfolder
        for config_path in (folder / subfolder / "config.json", folder / "config.json"):
            config = _read_json(config_path)
            if config and _config_matches(config, family.denoiser_config):
                found.append((len(family.denoiser_config), family.name, config["_class_name"]))
                break
    if found:
        _, name, kind = max(found, key=lambda entry: entry[0])
        return DetectedModel(name, kind)
    config = _read_json(folder / "config.json")
    if config and isinstance(config.get("_class_name"), str):
        return DetectedModel(None, config["_class_name"])
    return None


def _config_matches(config: dict, signature: dict) -> bool:
    # an entry a config leaves out has its default, which is None for the ones families name
    return bool(signature) and all(config.get(key) == value for key, value in signature.items())


def _detect_single_file(path: Path) -> DetectedModel | None:
    from modules.loading.safetensors_stream import SafetensorsStream

    stream = SafetensorsStream(path)  # reads the header only
    keys = stream.keys()
    matching = []
    for family in _families():
        if family.single_file_signature is None:
            continue
        present, absent = (re.compile(p) if p else None for p in family.single_file_signature)
        if any(present.search(k) for k in keys) and not (absent and any(absent.search(k) for k in keys)):
            matching.append(family)
    shaped = [f for f in matching if f.single_file_shape and _shape_holds(stream, keys, f.single_file_shape)]
    plain = [f for f in matching if not f.single_file_shape]
    if shaped or plain:
        family = (shaped or plain)[0]
        return DetectedModel(family.name, f"{family.label} checkpoint")
    for family in _families():  # before diffusers' classifier, which calls a Wan VAE a Wan model
        for part, signature in family.single_file_part_signatures.items():
            if any(re.search(signature, k) for k in keys):
                return DetectedModel(family.name, f"{family.label} {part} file", part)
    return _diffusers_model_type(stream)


def _shape_holds(stream, keys, shape: tuple[str, int, int]) -> bool:
    pattern, dimension, size = shape
    key = next((k for k in keys if re.search(pattern, k)), None)
    dims = stream.shape(key) if key else ()
    return len(dims) > dimension and dims[dimension] == size


def _diffusers_model_type(stream) -> DetectedModel | None:
    """diffusers' classifier of original-layout checkpoints (it knows SD3, Flux 2, video models,
    ...). It answers "v1" when nothing matches, so that answer is taken only where an SD UNet is there."""
    import torch
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    # it reads key names and a few shapes: meta tensors from the header carry both, with no data
    checkpoint = {key: torch.empty(stream.shape(key), dtype=stream.dtype(key), device="meta") for key in stream.keys()}
    try:
        model_type = infer_diffusers_model_type(checkpoint)
    except (KeyError, IndexError, AttributeError):
        return None
    if model_type == "v1" and not any(k.startswith("model.diffusion_model.input_blocks.") for k in checkpoint):
        return None
    return DetectedModel(None, f"{model_type!r} checkpoint (as diffusers names it)")


def family_mismatch(path: str | Path, family: str) -> str | None:
    """`model.base: ...` naming what the model at `path` is, when that is not `family`; None when it
    is, or when its files say nothing (the loader then names the problem). The trainer's preflight
    and the GUI (as soon as a model is chosen) show the same line."""
    detected = detect_model(path)
    if detected is not None and Path(path).is_file() and detected.family in get_family_class(family).single_files_of:
        detected = replace(detected, family=family)
    if detected is not None and detected.part and detected.family == family:
        return (f"model.base: {path} holds only a {detected.kind.removesuffix(' file')}; model.base is the file "
                f"of the {get_family_class(family).denoiser_part} (or a diffusers folder): give this file as "
                f"model.parts.{detected.part}.path")
    if detected is None or detected.family == family:
        return None
    if detected.family is None:
        what = (f"holds a {detected.kind}, which is not a model of a family this trainer trains "
                f"({', '.join(family_names())})")
    else:
        what = f"is a {get_family_class(detected.family).label} model ({detected.kind})"
    return (f"model.base: {path} {what}; the config says model.family {family!r} ({get_family_class(family).label})"
            + (f": set model.family to {detected.family!r}" if detected.family else ""))

