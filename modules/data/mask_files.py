"""Which file is an image's loss mask: `<image stem>-masklabel` with the first of these suffixes that
exists. Torch-free, so the dataset tool's window can ask it too (modules/data/masks.py loads them)."""

from __future__ import annotations

from pathlib import Path

MASK_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def mask_path(image: Path) -> Path | None:
    for suffix in MASK_SUFFIXES:
        candidate = image.with_name(f"{image.stem}-masklabel{suffix}")
        if candidate.is_file():
            return candidate
    return None
