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
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from modules.errors import UserError
from modules.util.atomic import write_errors

BACKUP_DIR = "backup"
BACKUP_FILES = ("adapter.safetensors", "state.pt", "config.json")  # what write_backup writes, all needed to resume
_BACKUP_NAME = re.compile(r"\d{8}-\d{6}-step\d+(-\d+)?")  # write_backup's folder names


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


def _backup_folders(workspace: Path) -> list[Path]:
    """Folders of backup/ that are backups or meant to be (named as write_backup names them, or
    holding a state.pt), complete or not, oldest first (names start with their time)."""
    root = Path(workspace) / BACKUP_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and (_BACKUP_NAME.fullmatch(p.name) or (p / "state.pt").is_file()))


def _missing(folder: Path) -> list[str]:
    return [name for name in BACKUP_FILES if not (folder / name).is_file()]


def list_backups(workspace: Path) -> list[Path]:
    """Complete backups (every file of BACKUP_FILES there), oldest first. The rolling count prunes
    only these: a folder with a file missing is the user's to mend or delete."""
    return [folder for folder in _backup_folders(workspace) if not _missing(folder)]


def newest_backup(workspace: Path) -> Path | None:
    """The backup --resume continues from: the newest. A newest folder with a file missing (copied
    or synced in part, a file deleted) is refused rather than passed over: resuming from the one
    before it would quietly train its steps again."""
    folders = _backup_folders(workspace)
    if not folders:
        return None
    newest = folders[-1]
    missing = _missing(newest)
    if missing:
        complete = list_backups(workspace)
        before = f"the backup before it ({complete[-1].name})" if complete else "step 0 (no complete backup is older)"
        raise BackupError(f"backup.resume: the newest backup {newest} is incomplete: it lacks {', '.join(missing)} "
                          f"(copied or synced in part, or a file deleted?). Put the missing file back to resume "
                          f"from it, or delete {newest} to resume from {before}")
    return newest


def damaged(folder: Path, problem: str) -> BackupError:
    """The error for a backup that cannot be resumed, with the way out (delete it: the resume then
    takes the one before)."""
    return BackupError(f"backup.resume: {problem}; delete {folder} to resume from the backup before it")


def read_backup_config(folder: Path) -> dict:
    """The config a backup was written with (a JSON object), its damage named with the way out."""
    path = folder / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # ValueError: JSON and UTF-8 errors
        raise damaged(folder, f"{folder} is damaged ({type(error).__name__}: {error})") from None
    if not isinstance(data, dict):
        raise damaged(folder, f"{path} holds {type(data).__name__}, not the JSON object of a config (damaged?)")
    return data


def read_backup(folder: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(adapter state, training state, config json) of a backup; never unpickles code. A damaged
    backup is named, with the way out (delete it: the resume then takes the one before)."""
    from modules.loading.torch_files import load_weights_only

    try:
        adapter = load_file(str(folder / "adapter.safetensors"))
        state = load_weights_only(folder / "state.pt", "backup.resume")
    except UserError as error:
        raise BackupError(f"{error}; delete {folder} to resume from the backup before it") from None
    except (SafetensorError, OSError, ValueError) as error:
        raise damaged(folder, f"{folder} is damaged ({type(error).__name__}: {error})") from None
    if not isinstance(state, dict):
        raise damaged(folder, f"{folder / 'state.pt'} holds {type(state).__name__}, not a training state (damaged?)")
    return adapter, state, read_backup_config(folder)
