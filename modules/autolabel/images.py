"""The images of a concept folder, as training reads them, and the caption file beside each.

Torch-free: the dataset tool's window reads these too."""

from __future__ import annotations

from pathlib import Path

MASK_SUFFIX = "-masklabel"  # modules/data/masks.py reads `<image stem>-masklabel.png`


def folder_images(folder: str | Path, include_subfolders: bool = False) -> list[Path]:
    """The images training reads from `folder`, in its order (masks excluded)."""
    from modules.data.concepts import IMAGE_SUFFIXES  # (here: the command line's parser reads this module)

    pattern = "**/*" if include_subfolders else "*"
    return sorted(p for p in Path(folder).glob(pattern)
                  if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and not p.stem.endswith(MASK_SUFFIX))


def caption_file(image: Path) -> Path:
    return image.with_suffix(".txt")


def mask_file(image: Path) -> Path:
    """Where a generated mask goes: the name modules/data/masks.py looks for first."""
    return image.with_name(f"{image.stem}{MASK_SUFFIX}.png")


def read_caption(image: Path) -> str:
    try:
        return caption_file(image).read_text(encoding="utf-8-sig").strip()
    except (OSError, UnicodeDecodeError):
        return ""
