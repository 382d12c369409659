"""Refuse to resume a backup into a run whose model or adapter shape differs from it.

Loading would fail on shapes anyway for some changes, but not for all (another base model of
the same architecture loads fine and silently trains a mismatched adapter), so compare the
settings that define what the adapter is attached to and what it is.
"""

from __future__ import annotations

from pathlib import Path

from modules.config.train_config import TrainConfig
from modules.trainer.guards import TrainingError

_MUST_MATCH = (
    ("model", "family"),
    ("model", "base"),
    ("adapter", "type"),
    ("adapter", "rank"),
    ("adapter", "layer_preset"),
    ("adapter", "layer_filter"),
)


def check_resume_compatible(backup_config: dict, config: TrainConfig, folder: Path) -> None:
    current = config.model_dump(mode="json")
    changes = []
    for path in _MUST_MATCH:
        old, new = backup_config, current
        for key in path:
            old = old.get(key) if isinstance(old, dict) else None
            new = new.get(key) if isinstance(new, dict) else None
        if old != new:
            changes.append(f"{'.'.join(path)}: {old!r} in the backup, {new!r} now")
    old_trained = sorted(k for k, v in backup_config.get("model", {}).get("parts", {}).items() if v.get("train"))
    new_trained = sorted(k for k, v in current["model"]["parts"].items() if v["train"])
    if old_trained != new_trained:
        changes.append(f"model.parts.*.train: {old_trained} in the backup, {new_trained} now")
    if changes:
        raise TrainingError(f"cannot resume from {folder}: the run changed in ways the backup cannot follow:\n  "
                            + "\n  ".join(changes))
