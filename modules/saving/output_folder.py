"""Where a diffusers-folder output goes: output.path without its .safetensors suffix, with
`output.if_exists` applied to the folder as output_target.py applies it to a file (a folder this
workspace's run wrote, per its output record, may be replaced by its resume)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from modules.saving.output_target import RECORD_NAME, OutputExistsError, versioned


def folder_for(path: Path) -> Path:
    path = Path(path)
    return path.with_suffix("") if path.suffix == ".safetensors" else path


def _written_by_workspace(workspace: Path, folder: Path) -> bool:
    try:
        record = json.loads((Path(workspace) / RECORD_NAME).read_text(encoding="utf-8"))
        return record["path"] == str(folder.resolve())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def resolve_output_folder(path: Path, policy: str, workspace: Path, resuming: bool,
                          warn: Callable[[str], None]) -> Path:
    folder = folder_for(path)
    if not folder.exists() or (resuming and _written_by_workspace(workspace, folder)):
        return folder
    if policy == "overwrite":
        warn(f"output.path: the folder {folder} exists (not written by this run) and will be replaced at the end "
             "(output.if_exists: overwrite)")
        return folder
    if policy == "refuse":
        raise OutputExistsError(f"the folder {folder} already exists and was not written by this run; choose "
                                "another output.path, or set output.if_exists to version or overwrite",
                                field="output.path")
    target = versioned(folder)
    warn(f"output.path: the folder {folder} exists (not written by this run); this run saves to {target} "
         "(output.if_exists: version)")
    return target
