"""Build a TrainConfig from layers: defaults <- preset <- config files <- `--set` overrides.

Each layer is a partial JSON object, migrated to the current version, then deep-merged: objects
merge key by key, anything else (lists included) replaces what was below. A layer (or `--set`)
that changes the `type` of a tagged section (method, adapter, optimizer) keeps from below only the
settings the new type declares alike (TaggedUnion.retype): a LoRA preset's rank stays for LoKr, and
is not an error for OFT, which has none.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

from pydantic import ValidationError

from modules.config.errors import ConfigError, format_validation_error
from modules.config.migrations import migrate
from modules.config.train_config import CURRENT_VERSION, TAGGED_SECTIONS, TrainConfig


def deep_merge(base: dict, overlay: dict) -> dict:
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def merge_layer(base: dict, overlay: dict) -> dict:
    """deep_merge, a tagged section whose type the overlay changes first retyped (tagged.py)."""
    for key, union in TAGGED_SECTIONS.items():
        above = overlay.get(key)
        if isinstance(above, dict) and "type" in above and key in base:
            base = {**base, key: union.retype(base[key], above["type"])}
    return deep_merge(base, overlay)


# far more than any config needs (about 5), far less than what would exhaust the recursion of the
# copies and validation that follow (Python's limit is ~1,000 frames)
MAX_NESTING = 100
_TOO_DEEP = object()  # json.loads gave up: deeper than its recursion allows


def _too_deep(data: Any) -> bool:
    """Whether objects and lists nest deeper than MAX_NESTING (walked without recursion)."""
    level = [data]
    for _ in range(MAX_NESTING):
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node)]
        if not level:
            return False
    return any(isinstance(node, (dict, list)) for node in level)


def read_json_file(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"file not found: {path}"]) from None
    except OSError as error:
        raise ConfigError([f"cannot read {path}: {error.strerror}"]) from None
    except UnicodeDecodeError as error:
        raise ConfigError([f"{path}: not UTF-8 text (byte {error.start})"]) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError([f"{path}: not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}"]) from None
    except RecursionError:  # json's parser recurses per level (at ~1,000 levels here)
        data = _TOO_DEEP
    if data is _TOO_DEEP or _too_deep(data):
        raise ConfigError([f"{path}: nested deeper than {MAX_NESTING} levels; a config is a few levels deep "
                           "(is this the file you meant?)"])
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: must hold a JSON object at the top level"])
    return migrate(data, source=str(path))


_SEGMENT = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
# what a key of --set looks like, for the message about one that is not
_KEY_FORM = "(names joined by '.', list items by [index]: schedule.epochs=5, concepts[0].repeats=3)"


def parse_dotted(key: str) -> list[str | int]:
    """'concepts[0].repeats' -> ['concepts', 0, 'repeats']."""
    steps: list[str | int] = []
    position = 0
    for match in _SEGMENT.finditer(key):
        between = key[position:match.start()]
        is_name = match.group(1) is not None
        # a name follows a '.' (or starts the key); an index follows what it indexes directly
        if between != ("." if is_name and steps else ""):
            raise ConfigError([f"--set {key}: cannot read the key {_KEY_FORM}"])
        steps.append(match.group(1) if is_name else int(match.group(2)))
        position = match.end()
    if not steps or position != len(key):
        raise ConfigError([f"--set {key}: cannot read the key {_KEY_FORM}"])
    return steps


def set_override(data: dict, assignment: str) -> dict:
    """Apply one `dotted.key=value` (value as JSON when it parses, else as text) to a new dict."""
    if "=" not in assignment:
        raise ConfigError([f"--set {assignment}: expected dotted.key=value"])
    key, raw = assignment.split("=", 1)
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    except RecursionError:
        value = _TOO_DEEP
    if value is _TOO_DEEP or _too_deep(value):
        raise ConfigError([f"--set {key.strip()}: the value is nested deeper than {MAX_NESTING} levels"])
    steps = parse_dotted(key.strip())
    root = json.loads(json.dumps(data))  # a deep copy of plain JSON
    if len(steps) == 2 and steps[1] == "type" and steps[0] in TAGGED_SECTIONS and steps[0] in root:
        root[steps[0]] = TAGGED_SECTIONS[steps[0]].retype(root[steps[0]], value)
    node: Any = root
    for index, step in enumerate(steps[:-1]):
        following = steps[index + 1]
        if isinstance(step, int):
            if not isinstance(node, list) or step > len(node):
                raise ConfigError([f"--set {key}: no list item [{step}] there"])
            if step == len(node):
                node.append({} if isinstance(following, str) else [])
            node = node[step]
        else:
            if not isinstance(node, dict):
                raise ConfigError([f"--set {key}: {step!r} is not inside an object"])
            node = node.setdefault(step, {} if isinstance(following, str) else [])
    last = steps[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or last > len(node):
            raise ConfigError([f"--set {key}: no list item [{last}] there"])
        node.append(value) if last == len(node) else node.__setitem__(last, value)
    else:
        if not isinstance(node, dict):
            raise ConfigError([f"--set {key}: {last!r} is not inside an object"])
        node[last] = value
    return root


def validate_config(data: dict, source: str | None = None) -> TrainConfig:
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, TrainConfig, data), source) from None


def build_config(layers: Iterable[dict], overrides: Iterable[str] = ()) -> TrainConfig:
    merged: dict = {"version": CURRENT_VERSION}
    for layer in layers:
        merged = merge_layer(merged, migrate(layer))
    for assignment in overrides:
        merged = set_override(merged, assignment)
    return validate_config(merged)


def load_config_file(path: str | Path, overrides: Iterable[str] = ()) -> TrainConfig:
    config = build_config([read_json_file(path)], overrides)
    return config


def config_overlay(config: TrainConfig) -> dict:
    """The smallest overlay that rebuilds `config` from the defaults (what a preset save writes)."""
    family = config.model.family
    defaults = TrainConfig.model_validate({"model": {"family": family}}).model_dump(mode="json")
    overlay = _difference(config.model_dump(mode="json"), defaults)
    # The family decides the defaults of the parts, so it is always written.
    overlay["model"] = {"family": family, **overlay.get("model", {})}
    return {"version": CURRENT_VERSION, **overlay}


def _difference(value: dict, default: dict) -> dict:
    """Keys of `value` that differ from `default`; a tagged object of another `type` is kept whole."""
    out = {}
    for key, item in value.items():
        if key == "version":
            continue
        if key not in default:
            out[key] = item
        elif isinstance(item, dict) and isinstance(default[key], dict) and item.get("type") == default[key].get("type"):
            nested = _difference(item, default[key])
            if nested:
                out[key] = nested
        elif item != default[key]:
            out[key] = item
    return out
