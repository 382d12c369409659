"""Concept folders -> (image path, caption) items.

Caption sources: `txt` (a .txt beside each image), `file` (one caption file for the whole
folder) or `filename` (the image's name, underscores as spaces). Files named `*-masklabel.*`
are masks, not training images.
"""

from __future__ import annotations

from modules.errors import UserError

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from modules.config.train_config import ConceptConfig

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp"}
# image files a user may expect to train that are not read (a .gif's frames, formats Pillow may lack)
UNREAD_IMAGE_SUFFIXES = {".gif", ".bmp", ".tif", ".tiff", ".avif", ".heic", ".heif", ".jxl"}


class DataError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class ConceptItem:
    image: Path
    caption: str
    concept: int  # index into config.concepts
    controls: tuple[Path, ...] = ()  # an edit sample's control (reference) images (pairs.py)


def check_concepts(concepts: list[ConceptConfig]) -> None:
    """Fail before anything slow happens: at least one enabled training concept, each enabled
    concept an existing folder."""
    enabled = [(i, c) for i, c in enumerate(concepts) if c.enabled]
    if not any(not c.validation for _, c in enabled):
        raise DataError("concepts: no enabled training concept (add a folder of images)")
    for index, concept in enabled:
        if not Path(concept.path).is_dir():
            raise DataError(f"concepts[{index}].path: {concept.path} is not a folder")


def read_caption(path: Path, where: str) -> str:
    """A caption file's text. utf-8-sig drops the byte-order mark Windows editors put first; other
    encodings are refused with the file named (guessing one could train on mojibake)."""
    try:
        return path.read_text(encoding="utf-8-sig").strip()
    except UnicodeDecodeError as error:
        raise DataError(f"{where}: caption file {path} is not UTF-8 text (byte 0x{error.object[error.start]:02x} "
                        f"at position {error.start}); save it as UTF-8") from None


def _caption_from_filename(path: Path) -> str:
    stem = re.sub(r"\s*\(\d+\)$", "", path.stem)  # "dog (2).png" is a copy of "dog.png"
    return stem.replace("_", " ").strip()


def scan_concept(index: int, concept: ConceptConfig, warn: Callable[[str], None],
                 clip_suffixes: frozenset[str] | set[str] = frozenset(), frame_folders: bool = False) -> list[ConceptItem]:
    """The concept's items: its images, and (a video concept, modules/data/video.py) files with
    `clip_suffixes` and, with `frame_folders`, each subfolder holding images (one clip of frames;
    its caption `<folder>.txt` beside it)."""
    where = f"concepts[{index}]"
    folder = Path(concept.path)
    if not folder.is_dir():
        raise DataError(f"{where}.path: {folder} is not a folder")
    pattern = "**/*" if concept.include_subfolders else "*"
    clip_folders = sorted(p for p in folder.iterdir() if p.is_dir() and any(
        f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES for f in p.iterdir())) if frame_folders else []
    files = [p for p in folder.glob(pattern) if p.is_file() and not any(d in p.parents for d in clip_folders)]
    read = IMAGE_SUFFIXES | set(clip_suffixes)
    images = sorted([p for p in files if p.suffix.lower() in read and not p.stem.endswith("-masklabel")]
                    + clip_folders)
    unread = sorted({p.suffix.lower() for p in files if p.suffix.lower() in UNREAD_IMAGE_SUFFIXES - read})
    if unread:
        count = sum(p.suffix.lower() in UNREAD_IMAGE_SUFFIXES - read for p in files)
        warn(f"{where}: {count} {'/'.join(unread)} file(s) in {folder} are not read (training reads "
             f"{', '.join(sorted(IMAGE_SUFFIXES))}); convert them to .png to train on them")
    shared_caption = None
    if concept.caption_source == "file":
        caption_path = folder / concept.caption_file
        if not caption_path.is_file():
            raise DataError(f"{where}.caption_file: {caption_path} not found")
        shared_caption = read_caption(caption_path, f"{where}.caption_file")
    items, without_caption = [], 0
    for image in images:
        if shared_caption is not None:
            caption = shared_caption
        elif concept.caption_source == "filename":
            caption = _caption_from_filename(image)
        else:
            text_file = image.with_suffix(".txt")
            if text_file.is_file():
                caption = read_caption(text_file, where)
            else:
                caption, without_caption = "", without_caption + 1
        items.append(ConceptItem(image, caption, index))
    if without_caption:
        warn(f"{where}: {without_caption} image(s) in {folder} have no .txt caption; training them with an empty caption")
    return items
