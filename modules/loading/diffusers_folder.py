"""Diffusers model folders: where a component's files are, and their identity for cache keys.

The loading itself is streamed_load.py's load_streamed: strict (diffusers and transformers both
initialise missing weights at random and only log it) and one tensor at a time.
"""

from __future__ import annotations

from modules.errors import UserError

import contextlib
from pathlib import Path


class ModelLoadError(UserError, ValueError):
    pass


def _quiet_loaders():
    """Silence the libraries' progress bars and 'newly initialized' chatter; problems are raised here."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def component_folder(base: str, subfolder: str, override: str | None, where: str) -> Path:
    """The folder holding a component: the override when given, else base/subfolder."""
    folder = Path(override) if override else Path(base) / subfolder
    if not override and not base:
        raise ModelLoadError(f"model.base: no model given (a diffusers folder with {subfolder}/)")
    if not override and not Path(base).is_dir():
        raise ModelLoadError(f"model.base: {base} is not a folder (expected a diffusers model folder)")
    if not folder.is_dir():
        source = where if override else "model.base"
        raise ModelLoadError(f"{source}: {folder} is not a folder (expected a diffusers component with config.json)")
    return folder


def weights_fingerprint(folder: Path) -> list[tuple[str, int, int]]:
    """Name, size and modification time of each file: cheap, and changes when the weights do."""
    with contextlib.suppress(FileNotFoundError):
        return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file()]
    return []

