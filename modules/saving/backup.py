"""Backups: everything needed to continue a run exactly where it was.

workspace/backup/<YYYYmmdd-HHMMSS>-step<N>/ holds
  adapter.safetensors   the adapter tensors (canonical kohya keys)
  state.pt              optimizer, LR scheduler, RNG states, data position (torch.load weights_only)
  config.json           the config of the run
A backup is assembled in a hidden temp folder and renamed into place, so a crash never leaves
a half-written backup where the resume would look.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from modules.errors import UserError
from modules.saving.atomic import write_errors

BACKUP_DIR = "backup"


class BackupError(UserError, ValueError):
    pass


def write_backup(workspace: Path, step: int, adapter_state: dict[str, torch.Tensor], state: dict,
                 config_json: dict, rolling_count: int) -> Path:
    root = Path(workspace) / BACKUP_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-step{step:07d}"
    final = root / name
    suffix = 1
    while final.exists():
        final, suffix = root / f"{name}-{suffix}", suffix + 1
    temp = root / f".tmp-{final.name}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        with write_errors(final):  # a full disk is named as such (torch.save's own words do not say it)
            save_file({k: v.detach().cpu().contiguous() for k, v in adapter_state.items()},
                      str(temp / "adapter.safetensors"))
            torch.save(state, temp / "state.pt")
            (temp / "config.json").write_text(json.dumps(config_json, indent=2), encoding="utf-8")
        temp.rename(final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    for old in list_backups(workspace)[:-rolling_count]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_unfinished_backups(workspace: Path) -> int:
    """Delete the temp folders (`.tmp-*`) of backups a killed run never finished; how many.
    Called with the workspace lock held, so no live run is writing one."""
    root = Path(workspace) / BACKUP_DIR
    if not root.is_dir():
        return 0
    unfinished = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(".tmp-")]
    for folder in unfinished:
        shutil.rmtree(folder, ignore_errors=True)
    return len(unfinished)


def list_backups(workspace: Path) -> list[Path]:
    """Complete backups, oldest first (names start with their time)."""
    root = Path(workspace) / BACKUP_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / "state.pt").is_file())


def newest_backup(workspace: Path) -> Path | None:
    backups = list_backups(workspace)
    return backups[-1] if backups else None


def read_backup(folder: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(adapter state, training state, config json) of a backup; never unpickles code. A damaged
    backup is named, with the way out (delete it: the resume then takes the one before)."""
    from modules.loading.torch_files import load_weights_only

    way_out = f"; delete {folder} to resume from the backup before it"
    try:
        adapter = load_file(str(folder / "adapter.safetensors"))
        state = load_weights_only(folder / "state.pt", "backup.resume")
        config_json = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except UserError as error:
        raise BackupError(f"{error}{way_out}") from None
    except (SafetensorError, OSError, ValueError) as error:  # ValueError: JSON and UTF-8 errors
        raise BackupError(f"backup.resume: {folder} is damaged ({type(error).__name__}: {error}){way_out}") from None
    return adapter, state, config_json
