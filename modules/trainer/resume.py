"""Resuming a backup into a run whose config changed: refuse what cannot follow, apply the rest.

Refused (loading would fail on shapes for some, but not for all: another base model of the same
architecture loads fine and silently trains a mismatched adapter; a LoRA of another alpha trains at
another scale): the settings that define what the adapter is attached to and what it is, and the
optimizer's type (the backup's optimizer state belongs to its own algorithm). Every other change is
reported and applied: hyperparameters (lr, betas, ...) and the LR schedule take this run's values
from the first resumed step, while the optimizer's state (moments, step counts, Prodigy's d) is kept.
"""

from __future__ import annotations

from pathlib import Path

import torch

from modules.config.adapter_configs import DEFAULT_ADAPTER_TYPE, AdapterConfigBase, resolve_dora_axis
from modules.config.errors import ConfigError
from modules.config.method_configs import METHODS
from modules.config.migrations import migrate
from modules.config.train_config import TrainConfig
from modules.trainer.guards import TrainingError

# What the adapter is attached to: the model (its family, weights and any part loaded from elsewhere).
_MODEL_FIELDS = (("model", "family"), ("model", "base"))
# What the adapter is: its algorithm, the shape of its tensors, the layers it sits on, its scale:
# the algorithm's own options and these shared ones. Not compared here: rank and alpha (by their
# per-part effect, below), dora_axis (as the axis it resolves to: a backup from before `auto`
# says "output"), and what only changes how it trains (dropouts, dtype, the start file).
_ADAPTER_FIELDS = ("type", "layer_preset", "layer_filter")
_ADAPTER_NOT_COMPARED = {"rank", "alpha", "parts", "dora_axis"} | set(AdapterConfigBase.model_fields)


def _adapter_fields(config: TrainConfig) -> list[str]:
    own = [name for name in type(config.adapter).model_fields if name not in _ADAPTER_NOT_COMPARED]
    return [*_ADAPTER_FIELDS, *own]


def _get(tree: dict, path: tuple[str, ...], default=None):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return default
        tree = tree[key]
    return tree


def _size(adapter: dict, part: str, defaults: dict) -> tuple:
    """(rank, alpha) of a part as adapter.size_for gives it, read from a dumped config."""
    override = (adapter.get("parts") or {}).get(part) or {}
    rank = override.get("rank") if override.get("rank") is not None else adapter.get("rank", defaults.get("rank"))
    alpha = override.get("alpha") if override.get("alpha") is not None else adapter.get("alpha", defaults.get("alpha"))
    return rank, float(alpha or 0)


def _trained_embeddings(embeddings: list[dict]) -> list[str]:
    """The trained embeddings as `placeholder x vectors` (a start file brings its own count: `from file`)."""
    return [f"{e.get('placeholder')} x {'from file' if e.get('path') else e.get('vectors', 1)}"
            for e in embeddings if e.get("train", True)]


def _shape_problem(value, default, path: str) -> str | None:
    """Where `value` (a dumped config) has a scalar or list where `default` has an object, or the reverse."""
    if isinstance(default, dict):
        if not isinstance(value, dict):
            return f"{path or 'the file'} is {type(value).__name__}, not an object"
        for key in value.keys() & default.keys():
            problem = _shape_problem(value[key], default[key], f"{path}.{key}" if path else key)
            if problem:
                return problem
    elif isinstance(default, list) and not isinstance(value, list):
        return f"{path} is {type(value).__name__}, not a list"
    return None


def backup_config_problem(backup_config: dict) -> str | None:
    """Why the comparisons below cannot read a backup's config.json (objects where they read keys),
    or None. Fields unknown to this trainer pass: an older backup may have them."""
    try:
        backup_config = migrate(backup_config)
    except ConfigError as error:
        return "; ".join(error.problems)
    problem = _shape_problem(backup_config, TrainConfig().model_dump(mode="json"), "")
    if problem:
        return problem
    # objects of per-part objects (their keys are the family's parts); an adapter part may be null
    for path, may_be_null in (("model.parts", False), ("adapter.parts", True)):
        named = _get(backup_config, tuple(path.split(".")), {}) or {}
        if not isinstance(named, dict):
            return f"{path} is not an object"
        bad = [key for key, item in named.items() if not (isinstance(item, dict) or may_be_null and item is None)]
        if bad:
            return f"{path}.{bad[0]} is not an object"
    if not all(isinstance(item, dict) for item in backup_config.get("embeddings") or []):
        return "embeddings holds an item that is not an object"
    return None


def resume_changes(backup_config: dict, config: TrainConfig) -> list[str]:
    """One line per setting that differs between the backup's config and this run's, naming its dotted path."""
    backup_config = migrate(backup_config)
    current = config.model_dump(mode="json")
    # a backup written before a field existed had that field's default (the adapter's: of this run's algorithm)
    defaults = TrainConfig().model_dump(mode="json")
    defaults["adapter"] = {**type(config.adapter)().model_dump(mode="json"), "type": DEFAULT_ADAPTER_TYPE}
    changes = []

    def compare(path: tuple[str, ...], label: str | None = None) -> None:
        old, new = _get(backup_config, path, _get(defaults, path)), _get(current, path)
        if old != new:
            changes.append(f"{label or '.'.join(path)}: {old!r} in the backup, {new!r} now")

    for path in _MODEL_FIELDS:
        compare(path)
    compare(("method", "type"))  # the backup's weights are another method's
    old_parts = _get(backup_config, ("model", "parts"), {}) or {}
    new_parts = current["model"]["parts"]
    for part in sorted(set(old_parts) | set(new_parts)):
        compare(("model", "parts", part, "path"))
    old_trained = sorted(k for k, v in old_parts.items() if v.get("train"))
    new_trained = sorted(k for k, v in new_parts.items() if v["train"])
    if old_trained != new_trained:
        changes.append(f"model.parts.*.train: {old_trained} in the backup, {new_trained} now")

    old_embeddings = _trained_embeddings(backup_config.get("embeddings") or [])
    new_embeddings = _trained_embeddings(current.get("embeddings") or [])
    if old_embeddings != new_embeddings:  # the backup holds these vectors, one tensor per placeholder
        changes.append(f"embeddings: trained {old_embeddings} in the backup, {new_embeddings} now")

    if not METHODS.traits(config.method.type).uses_adapter:
        return changes  # the adapter settings are not read: a change of them changes nothing trained
    for field in _adapter_fields(config):
        compare(("adapter", field))
    if getattr(config.adapter, "dora", False):
        old_axis = _get(backup_config, ("adapter", "dora_axis"), "output")  # before `auto`, output was the default
        old_axis = resolve_dora_axis(old_axis, _get(backup_config, ("output", "format"), "kohya"))
        new_axis = config.adapter.resolved_dora_axis(config.output.format)
        if old_axis != new_axis:
            changes.append(f"adapter.dora_axis: {old_axis!r} in the backup, {new_axis!r} now")
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


def _optimizer_type_change(backup_config: dict, config: TrainConfig) -> list[str]:
    old = _get(backup_config, ("optimizer", "type"), _get(TrainConfig().model_dump(mode="json"), ("optimizer", "type")))
    if old == config.optimizer.type:
        return []
    return [f"optimizer.type: {old!r} in the backup, {config.optimizer.type!r} now (the backup's optimizer "
            f"state belongs to {old}; to switch optimizers, start a new run with adapter.init_from set to the "
            "backup's adapter.safetensors)"]


def _leaves(tree, prefix: str = "") -> dict[str, object]:
    """Dotted path -> value of every leaf of a dumped config (a list is one leaf)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}.{key}" if prefix else key))
    return out


# not settings of the training: how this run was started, and the file format
_NOT_COMPARED = {"version", "backup.resume"}


def describe_changes(backup_config: dict, config: TrainConfig) -> list[str]:
    """Every setting that differs between the backup's config and this run's, as 'path: old -> new'."""
    backup_config = migrate(backup_config)
    defaults = _leaves(TrainConfig.model_validate({"model": {"family": config.model.family}}).model_dump(mode="json"))
    old, new = _leaves(backup_config), _leaves(config.model_dump(mode="json"))
    changes = []
    for path in sorted(set(old) | set(new)):
        if path in _NOT_COMPARED:
            continue
        before, after = old.get(path, defaults.get(path)), new.get(path, defaults.get(path))
        if before != after:
            changes.append(f"{path}: {before!r} -> {after!r}")
    return changes


def _differs(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):  # some optimizers keep a tensor lr
        return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b))
    return a != b


def apply_current_hyperparameters(optimizer: torch.optim.Optimizer, current: list[dict],
                                  backup_fresh: list[dict] | None) -> None:
    """After `optimizer.load_state_dict`, put back this run's value of every group setting this run's
    config changed: where `current` (this run's fresh groups) differs from `backup_fresh` (a fresh
    optimizer of the backup's config). Settings equal in both keep their loaded value, which is the
    optimizer's own state where it keeps some in the group (Prodigy's d). Without `backup_fresh`,
    this run's settings all apply."""
    for index, (group, mine) in enumerate(zip(optimizer.param_groups, current)):
        theirs = backup_fresh[index] if backup_fresh is not None and index < len(backup_fresh) else None
        for key, value in mine.items():
            if theirs is None or key not in theirs or _differs(theirs[key], value):
                group[key] = value


def follow_current_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """After `scheduler.load_state_dict`, which restores the backup's base lrs: this run's base lrs
    (the groups' initial_lr) and this run's schedule at the resumed step."""
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [group["initial_lr"] for group in groups]
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]


def check_resume_compatible(backup_config: dict, config: TrainConfig, folder: Path) -> None:
    changes = resume_changes(backup_config, config) + _optimizer_type_change(backup_config, config)
    if changes:
        raise TrainingError(f"cannot resume from {folder}: the run changed in ways the backup cannot follow "
                            "(change them back, or start without --resume in a new workspace):\n  "
                            + "\n  ".join(changes))
