"""Built-in presets that were renamed, old name -> new name: a saved config, a script or a habit
that names the old preset still loads it, and is told once (per process) the name to use now."""

from __future__ import annotations

import warnings

# the embedding presets took a VRAM tier in their name (issue 30): each old name loads the tier whose
# settings it had, the roomier one where the family now has two
RENAMED_PRESETS = {
    "SD1.5 embedding": "SD1.5 embedding 8GB",
    "SDXL embedding": "SDXL embedding 24GB",
    "SD3.5 embedding": "SD3.5 embedding 24GB",
    "Flux embedding": "Flux embedding 24GB",
    "Chroma embedding": "Chroma embedding 24GB",
    "Z-Image embedding": "Z-Image embedding 24GB",
    "Qwen-Image embedding": "Qwen-Image embedding 24GB",
    "FLUX.2 klein embedding": "FLUX.2 klein embedding 24GB",
}

_warned: set[str] = set()


def renamed_preset(name: str) -> str | None:
    """The current name of a renamed built-in preset (matched case-insensitively, as preset names
    are), warning the first time each old name is used; None when `name` is no old name."""
    new = next((new for old, new in RENAMED_PRESETS.items() if old.lower() == name.lower()), None)
    if new is not None and new not in _warned:
        _warned.add(new)
        warnings.warn(f"preset {name!r} is now called {new!r}; loading {new!r} (use the new name)",
                      FutureWarning, stacklevel=3)
    return new
