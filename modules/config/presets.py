"""Presets: named partial configs. Built-ins live in resources/presets/<family>/<name>.json and
ship with the trainer; user presets live in <user dir>/presets/<name>.json.

Saving a preset writes only what differs from the defaults of its family (plus "version" and
"model.family"), so a preset keeps working when a default improves and stays short to share.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from modules.config.errors import ConfigError
from modules.config.loading import config_overlay, read_json_file
from modules.config.preset_aliases import renamed_preset
from modules.config.train_config import TrainConfig
from modules.util.atomic import write_text
from modules.util.did_you_mean import did_you_mean

BUILTIN_PRESETS_DIR = Path(__file__).resolve().parents[2] / "resources" / "presets"


def user_dir() -> Path:
    """Where user presets and the GUI's last config live; DIFFTRAINER_HOME overrides it."""
    if os.environ.get("DIFFTRAINER_HOME"):
        return Path(os.environ["DIFFTRAINER_HOME"])
    return Path.home() / ".config" / "difftrainer"


def user_presets_dir() -> Path:
    return user_dir() / "presets"


@dataclass(frozen=True)
class PresetInfo:
    name: str
    family: str | None
    builtin: bool
    path: Path


def list_presets() -> list[PresetInfo]:
    presets = [
        PresetInfo(path.stem, path.parent.name, True, path)
        for path in sorted(BUILTIN_PRESETS_DIR.glob("*/*.json"))
    ]
    folder = user_presets_dir()
    if folder.is_dir():
        for path in sorted(folder.glob("*.json")):
            try:
                family = read_json_file(path).get("model", {}).get("family")
            except ConfigError:
                family = None  # listed anyway; loading it names the problem
            presets.append(PresetInfo(path.stem, family, False, path))
    return presets


MAX_NAME_LENGTH = 100  # well under the 255 bytes file systems allow, with room for ".json" and a temp suffix
_NAME_CHARACTERS = re.compile(r"^[\w .-]+$")  # \w: letters of any script, digits, "_"
# names Windows reserves for devices, with any extension: a preset file shared there must open
_WINDOWS_DEVICES = re.compile(r"^(con|prn|aux|nul|com[0-9]|lpt[0-9])(\..*)?$", re.IGNORECASE)


def check_preset_name(name: str) -> None:
    """A preset name is its file name: one that every file system takes, or a ConfigError saying why."""
    shown = repr(name if len(name) <= 40 else name[:40] + "...")
    if not name or not name.strip():
        problem = "is empty"
    elif len(name) > MAX_NAME_LENGTH:
        problem = f"is {len(name)} characters long (at most {MAX_NAME_LENGTH})"
    elif not _NAME_CHARACTERS.match(name):
        problem = "use letters, digits, spaces, '-', '_' or '.'"
    elif name.startswith(".") or name != name.strip() or name.endswith("."):
        problem = "must not start with '.' nor start or end with a space or end with '.'"
    elif _WINDOWS_DEVICES.match(name):
        problem = "is a device name on Windows"
    else:
        return
    raise ConfigError([f"preset name {shown}: {problem}"])


def find_preset(name: str) -> PresetInfo:
    """User presets shadow built-ins of the same name; names match case-insensitively. The old name
    of a renamed built-in (a user preset of that name aside) finds it under its new name, with a warning."""
    check_preset_name(name)
    matches = [p for p in list_presets() if p.name.lower() == name.lower()]
    if not matches and (new := renamed_preset(name)):
        matches = [p for p in list_presets() if p.name == new and p.builtin]
    if not matches:
        names = sorted({p.name for p in list_presets()})
        # the suggestion first: the full list of ~100 names hides it (`launch.py presets` lists them)
        raise ConfigError([f"preset {name!r} not found{did_you_mean(name, names)} (known: {', '.join(names)})"])
    return next((p for p in matches if not p.builtin), matches[0])


def load_preset_overlay(name: str) -> dict:
    preset = find_preset(name)
    overlay = read_json_file(preset.path)
    if preset.builtin and preset.family:
        overlay.setdefault("model", {}).setdefault("family", preset.family)
    return overlay


def save_preset(config: TrainConfig, name: str) -> Path:
    check_preset_name(name)
    path = user_presets_dir() / f"{name}.json"
    overlay = config_overlay(config)
    # resuming is a choice of one run (a resumed run's config.json says it), not part of a recipe
    backup = overlay.get("backup", {})
    backup.pop("resume", None)
    if not backup:
        overlay.pop("backup", None)
    write_text(path, json.dumps(overlay, indent=2) + "\n")
    return path
