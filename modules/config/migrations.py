"""Versioned config migrations: MIGRATIONS[v] turns a version-v dict into a version-(v+1) dict.

A file without "version" is taken to be written for the current version (hand-written overlays
rarely say it), unless it has keys that only an older version had (`_looks_v1`); every file this
trainer writes carries it. Add a step here whenever a field is renamed or moved, and a test with
a real file of the old shape.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from modules.config.errors import ConfigError
from modules.config.train_config import CURRENT_VERSION


def _set(tree: dict, dotted: str, value: Any, origin: str, owners: dict[str, str], above: str = "") -> None:
    """tree[dotted] = value for version 0's key `origin`; objects merge, and a place another key of
    the file already holds (`"model": "abc"` beside `model_family`) is refused, naming both keys.
    `owners`: which key of the file set each place so far."""
    keys = dotted.split(".")
    for depth, key in enumerate(keys):
        place = above + ".".join(keys[:depth + 1])
        last = depth == len(keys) - 1
        if key not in tree:
            owners[place] = origin
            if last:
                tree[key] = value
                return
            tree[key] = {}
        elif last and isinstance(tree[key], dict) and isinstance(value, dict):
            for inner, item in value.items():
                _set(tree[key], inner, item, origin, owners, place + ".")
            return
        elif last or not isinstance(tree[key], dict):
            raise ConfigError([f"{place}: set by both {owners.get(place, '?')!r} and {origin!r} of this version-0 "
                               f"file (version 0's keys move into the current layout); keep one of them"])
        tree = tree[key]


# v0 was the flat layout of the first presets (OneTrainer-like names at the top level).
_V0_FLAT_KEYS = {
    "model_family": "model.family",
    "base_model": "model.base",
    "prediction_type": "model.prediction_type",
    "lora_rank": "adapter.rank",
    "lora_alpha": "adapter.alpha",
    "lora_dropout": "adapter.dropout",
    "learning_rate": "optimizer.lr",
    "weight_decay": "optimizer.weight_decay",
    "lr_scheduler": "lr_scheduler.type",
    "lr_warmup_steps": "lr_scheduler.warmup_steps",
    "epochs": "schedule.epochs",
    "max_steps": "schedule.max_steps",
    "batch_size": "schedule.batch_size",
    "gradient_accumulation_steps": "schedule.gradient_accumulation",
    "resolution": "data.resolution",
    "output_path": "output.path",
    "output_dtype": "output.dtype",
    "workspace": "workspace_dir",
    "cache": "cache_dir",
    "device": "train_device",
    "seed": "seed",
}


def _v0_to_v1(old: dict) -> dict:
    new: dict = {}
    owners: dict[str, str] = {}
    for key, value in old.items():
        if key == "version":
            continue
        if key in _V0_FLAT_KEYS:
            _set(new, _V0_FLAT_KEYS[key], value, key, owners)
        elif key == "train_text_encoder":
            _set(new, "model.parts.text_encoder.train", value, key, owners)
        elif key == "text_encoder_learning_rate":
            _set(new, "model.parts.text_encoder.learning_rate", value, key, owners)
        elif key == "unet_learning_rate":
            _set(new, "model.parts.unet.learning_rate", value, key, owners)
        elif key == "weight_dtype":
            for part in ("text_encoder", "unet", "vae"):
                _set(new, f"model.parts.{part}.weight_dtype", value, key, owners)
        elif key in ("sample_every_n_steps", "save_every_n_steps", "backup_every_n_steps"):
            action = key.split("_every")[0]
            _set(new, f"schedule.{action}_every", {"value": value, "unit": "steps"}, key, owners)
        elif key == "concepts" and isinstance(value, list):
            _set(new, "concepts", value, key, owners)  # (a list is one value: nothing else moves into it)
            new["concepts"] = [
                {("path" if k == "folder" else k): v for k, v in concept.items()} if isinstance(concept, dict) else concept
                for concept in value
            ]
        else:
            _set(new, key, value, key, owners)  # unknown in v0 too: validation will name it
    new["version"] = 1
    return new


# v1 had one flat adapter object: every algorithm's options side by side (ignored by the others).
# v2's adapter is a union on `type`, each algorithm with only its own options, named without prefix.
_V1_OWN_FIELDS = {
    "lokr": {"lokr_factor": "factor", "lokr_decompose_both": "decompose_both", "lokr_full_matrix": "full_matrix"},
    "oft": {"oft_block_size": "block_size", "oft_constraint": "constraint"},
}
# v1's defaults: a prefixed field at its default says nothing (it was in every full dump) and is dropped
_V1_DEFAULTS = {"lokr_factor": -1, "lokr_decompose_both": False, "lokr_full_matrix": False,
                "oft_block_size": 32, "oft_constraint": 0.0}
# v1 fields that only some algorithms used -> those algorithms (the others ignored them)
_V1_SHARED_BY_SOME = {"rank": ("lora", "loha", "lokr"), "alpha": ("lora", "loha", "lokr"),
                      "parts": ("lora", "loha", "lokr"), "dora": ("lora", "lokr"), "dora_axis": ("lora", "lokr")}


def _looks_v1(data: dict) -> bool:
    adapter = data.get("adapter")
    return isinstance(adapter, dict) and any(key in adapter for own in _V1_OWN_FIELDS.values() for key in own)


def _v1_adapter(old: dict) -> dict:
    kind = old.get("type")  # None in an overlay that leaves the type to a layer below
    new = {}
    for key, value in old.items():
        owner = next((name for name, own in _V1_OWN_FIELDS.items() if key in own), None)
        if owner is not None:
            if kind is None and value == _V1_DEFAULTS[key]:
                continue  # its default in v2 too
            if kind in (None, owner):
                new[_V1_OWN_FIELDS[owner][key]] = value
            # another algorithm's option: v1 ignored it
        elif key in _V1_SHARED_BY_SOME and kind is not None and kind not in _V1_SHARED_BY_SOME[key]:
            if key == "dora" and value:
                new[key] = value  # v1 refused it too: validation names it
        else:
            new[key] = value
    return new


def _v1_to_v2(old: dict) -> dict:
    new = dict(old)
    if isinstance(old.get("adapter"), dict):
        new["adapter"] = _v1_adapter(old["adapter"])
    new["version"] = 2
    return new


MIGRATIONS: dict[int, Callable[[dict], dict]] = {0: _v0_to_v1, 1: _v1_to_v2}


def migrate(data: dict, source: str | None = None) -> dict:
    """Return `data` lifted to CURRENT_VERSION (a new dict; the input is not changed)."""
    version = data.get("version", 1 if _looks_v1(data) else CURRENT_VERSION)
    if not isinstance(version, int) or isinstance(version, bool):
        raise ConfigError([f"version: must be a whole number (got {version!r})"], source)
    if version > CURRENT_VERSION:
        raise ConfigError(
            [f"version: {version} is newer than this trainer understands ({CURRENT_VERSION}); update the trainer"],
            source,
        )
    if version < 0:
        raise ConfigError([f"version: must be >= 0 (got {version})"], source)
    data = copy.deepcopy(data)
    while version < CURRENT_VERSION:
        try:
            data = MIGRATIONS[version](data)
        except ConfigError as error:  # a step names the key; the file is named here
            raise ConfigError(error.problems, source) from None
        version += 1
    data["version"] = CURRENT_VERSION
    return data
