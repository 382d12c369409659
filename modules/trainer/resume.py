"""Refuse to resume a backup into a run whose model or adapter differs from it.

Loading would fail on shapes anyway for some changes, but not for all (another base model of
the same architecture loads fine and silently trains a mismatched adapter; a LoRA of another
alpha loads and trains at another scale), so compare the settings that define what the adapter
is attached to and what it is, and name every one that changed with its dotted path.
"""

from __future__ import annotations

from pathlib import Path

from modules.config.train_config import TrainConfig
from modules.trainer.guards import TrainingError

# What the adapter is attached to: the model (its family, weights and any part loaded from elsewhere).
_MODEL_FIELDS = (("model", "family"), ("model", "base"))
# What the adapter is: its algorithm, the shape of its tensors, the layers it sits on, its scale.
_ADAPTER_FIELDS = ("type", "dora", "dora_axis", "lokr_factor", "lokr_decompose_both", "lokr_full_matrix",
                   "oft_block_size", "layer_preset", "layer_filter")


def _get(tree: dict, path: tuple[str, ...], default=None):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return default
        tree = tree[key]
    return tree


def _size(adapter: dict, part: str, defaults: dict) -> tuple:
    """(rank, alpha) of a part as adapter.size_for gives it, read from a dumped config."""
    override = (adapter.get("parts") or {}).get(part) or {}
    rank = override.get("rank") if override.get("rank") is not None else adapter.get("rank", defaults["rank"])
    alpha = override.get("alpha") if override.get("alpha") is not None else adapter.get("alpha", defaults["alpha"])
    return rank, float(alpha)


def resume_changes(backup_config: dict, config: TrainConfig) -> list[str]:
    """One line per setting that differs between the backup's config and this run's, naming its dotted path."""
    current = config.model_dump(mode="json")
    # a backup written before a field existed had that field's default
    defaults = TrainConfig().model_dump(mode="json")
    changes = []

    def compare(path: tuple[str, ...], label: str | None = None) -> None:
        old, new = _get(backup_config, path, _get(defaults, path)), _get(current, path)
        if old != new:
            changes.append(f"{label or '.'.join(path)}: {old!r} in the backup, {new!r} now")

    for path in _MODEL_FIELDS:
        compare(path)
    old_parts = _get(backup_config, ("model", "parts"), {}) or {}
    new_parts = current["model"]["parts"]
    for part in sorted(set(old_parts) | set(new_parts)):
        compare(("model", "parts", part, "path"))
    old_trained = sorted(k for k, v in old_parts.items() if v.get("train"))
    new_trained = sorted(k for k, v in new_parts.items() if v["train"])
    if old_trained != new_trained:
        changes.append(f"model.parts.*.train: {old_trained} in the backup, {new_trained} now")

    for field in _ADAPTER_FIELDS:
        compare(("adapter", field))
    old_adapter, new_adapter = backup_config.get("adapter") or {}, current["adapter"]
    for part in sorted(set(old_trained) & set(new_trained)):  # the effective size of each trained part
        old_size = _size(old_adapter, part, defaults["adapter"])
        new_size = _size(new_adapter, part, defaults["adapter"])
        for index, name in enumerate(("rank", "alpha")):
            if old_size[index] == new_size[index]:
                continue
            overridden = any(((a.get("parts") or {}).get(part) or {}).get(name) is not None
                             for a in (old_adapter, new_adapter))
            line = (f"adapter.parts.{part}.{name}" if overridden else f"adapter.{name}") + \
                f": {old_size[index]!r} in the backup, {new_size[index]!r} now"
            if line not in changes:
                changes.append(line)
    return changes


def check_resume_compatible(backup_config: dict, config: TrainConfig, folder: Path) -> None:
    changes = resume_changes(backup_config, config)
    if changes:
        raise TrainingError(f"cannot resume from {folder}: the run changed in ways the backup cannot follow "
                            "(change them back, or start without --resume in a new workspace):\n  "
                            + "\n  ".join(changes))
