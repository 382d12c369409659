"""Load one model component from a diffusers folder, strictly and offline.

diffusers and transformers both initialise missing weights at random and only log it; a
checkpoint whose keys do not fit the architecture would then train on noise. Here any missing,
unexpected or mismatched key refuses the load, naming the keys.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch


class ModelLoadError(ValueError):
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


def _keys(value: Any) -> list[str]:
    return sorted(str(k if not isinstance(k, tuple) else k[0]) for k in (value or []))


def load_component(cls: Any, folder: Path, dtype: torch.dtype, where: str, **kwargs: Any) -> torch.nn.Module:
    _quiet_loaders()
    try:
        model, info = cls.from_pretrained(
            str(folder), torch_dtype=dtype, output_loading_info=True, local_files_only=True, **kwargs
        )
    except (OSError, ValueError, EnvironmentError) as error:
        raise ModelLoadError(f"{where}: cannot load {cls.__name__} from {folder}: {error}") from None
    problems = []
    for label, key in (("missing", "missing_keys"), ("unexpected", "unexpected_keys"), ("mismatched", "mismatched_keys")):
        names = _keys(info.get(key))
        if names:
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            problems.append(f"{label} keys: {shown}")
    if info.get("error_msgs"):
        problems.append("errors: " + "; ".join(str(m) for m in info["error_msgs"]))
    if problems:
        raise ModelLoadError(
            f"{where}: the checkpoint in {folder} does not fit {cls.__name__} (refusing to initialise weights at random): "
            + "; ".join(problems)
        )
    return model.requires_grad_(False).eval()


def weights_fingerprint(folder: Path) -> list[tuple[str, int, int]]:
    """Name, size and modification time of each file: cheap, and changes when the weights do."""
    with contextlib.suppress(FileNotFoundError):
        return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file()]
    return []

