"""Where the final adapter goes, decided before training so a good file is never lost.

An existing file at `output.path` that this run did not write is kept: the run is refused before
the model loads (`output.if_exists: refuse`), writes beside it as `name-2.safetensors`
(`version`, the default), or replaces it (`overwrite`). "This run" includes the run a `--resume`
continues: the workspace records the file its run saved (path, size, mtime), and a resumed run
may replace exactly that file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from modules.errors import UserError
from modules.util.atomic import write_text

RECORD_NAME = "output.json"


class OutputExistsError(UserError):
    """`output.path` holds a file of another run and `output.if_exists` is refuse."""


def _fingerprint(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def record_output(workspace: Path, requested: Path, written: Path) -> None:
    """Remember the file this workspace's run saved for `output.path` = `requested` (perhaps a
    versioned name): a resume of the run replaces that file."""
    record = {"requested": str(Path(requested).resolve()), **_fingerprint(Path(written))}
    write_text(Path(workspace) / RECORD_NAME, json.dumps(record, indent=2))


def workspace_output(workspace: Path, requested: Path) -> Path | None:
    """The file this workspace's run saved for `requested`, if it is still exactly that file."""
    try:
        record = json.loads((Path(workspace) / RECORD_NAME).read_text(encoding="utf-8"))
        written = Path(record["path"])
        if record["requested"] != str(Path(requested).resolve()) or not written.is_file():
            return None
        return written if {**record, **_fingerprint(written)} == record else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def output_file_problem(path: Path, raw: str) -> str | None:
    """Why `path` (`output.path`, typed as `raw`) cannot take the saved file, or None. Every method
    and output.format writes safetensors, so a path without that suffix is refused rather than
    renamed behind the user's back (a `.pt` or `.ckpt` name would promise a pickle)."""
    if path.is_dir() or raw.endswith(("/", os.sep)):
        return f"output.path: {path} is a folder; name the file to write, e.g. {path / 'lora.safetensors'}"
    if path.exists() and not path.is_file():  # /dev/null, a FIFO, a socket: versioning would write beside it
        return (f"output.path: {path} is not a regular file (a device, pipe or socket); "
                "name a .safetensors file in a folder of yours")
    if path.suffix != ".safetensors":
        return (f"output.path: {path} does not end in .safetensors, the format every saved file is written "
                f"in; name it e.g. {path.with_name(path.name + '.safetensors')}")
    return None


def saved_files(path: Path, suffixes: Sequence[str] = ("",)) -> list[Path]:
    """The files a save to `path` writes: one per suffix after its stem (Wan 2.2's `-high_noise`,
    `-low_noise`: ModelFamily.adapter_files)."""
    return [path.with_name(f"{path.stem}{suffix}{path.suffix}") for suffix in suffixes]


def versioned(path: Path, suffixes: Sequence[str] = ("",)) -> Path:
    """The first of name-2.ext, name-3.ext, ... none of whose saved files exists."""
    number = 2
    while True:
        candidate = path.with_name(f"{path.stem}-{number}{path.suffix}")
        if not any(file.exists() for file in saved_files(candidate, suffixes)):
            return candidate
        number += 1


def resolve_output(path: Path, policy: str, workspace: Path, resuming: bool,
                   warn: Callable[[str], None], suffixes: Sequence[str] = ("",)) -> Path:
    """The path the final save writes to, under `policy` (refuse / version / overwrite), looking at
    every file the save writes (`suffixes`: saved_files)."""
    if resuming:
        own = workspace_output(workspace, path)
        if own is not None:
            return own  # the earlier part of this very run saved it (perhaps as name-2)
    if path.is_dir():
        raise UserError(f"{path} is a folder; give the adapter's file name (e.g. {path / 'lora.safetensors'})",
                        field="output.path")
    if path.exists() and not path.is_file():
        raise UserError(f"{path} is not a regular file (a device, pipe or socket); name a .safetensors file "
                        "in a folder of yours", field="output.path")
    existing = [file for file in saved_files(path, suffixes) if file.exists()]
    if not existing:
        return path
    named = ", ".join(map(str, existing))
    if policy == "overwrite":
        warn(f"output.path: {named} exists (not written by this run) and will be replaced at the end "
             "(output.if_exists: overwrite)")
        return path
    if policy == "refuse":
        raise OutputExistsError(
            f"{named} already exists and was not written by this run; choose another output.path, or set "
            "output.if_exists to version (save beside it as name-2) or overwrite", field="output.path")
    target = versioned(path, suffixes)
    warn(f"output.path: {named} exists (not written by this run); this run saves to "
         f"{', '.join(map(str, saved_files(target, suffixes)))} (output.if_exists: version)")
    return target
