"""Masker kinds: one file each in this folder, declaring which model folders it takes.

A kind is a `MaskerKind` registered with `register`; `masker_kind_for(folder)` asks each kind in
`order` whether it takes the folder (by its files and configs, never by its name) and the first
that does loads it. A masker gives, per image, an (height, width) probability map at the image's
own size that modules/autolabel/mask_folder.py thresholds and writes. Nothing here knows a kind by
name: a new kind is a new file."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from modules.autolabel.model_folder import LabelModelError


class Masker(Protocol):
    def probabilities(self, images: list, prompt: str) -> list:
        """Per image (PIL RGB), an (height, width) float array in [0, 1] at the image's size."""


@dataclass(frozen=True)
class MaskerKind:
    name: str
    describes: str  # what it takes, for the message when no kind does
    takes: Callable[[Path], bool]  # folder -> whether this kind masks with it (read without torch)
    load: Callable[..., Masker]  # (folder, device, dtype) -> a ready masker
    takes_prompt: bool  # whether the mask follows a text prompt (CLIPSeg) or is the model's alone (background removal)
    order: int = 100


_KINDS: dict[str, MaskerKind] = {}


def register(kind: MaskerKind) -> MaskerKind:
    _KINDS[kind.name] = kind
    return kind


def kinds() -> list[MaskerKind]:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return sorted(_KINDS.values(), key=lambda kind: (kind.order, kind.name))


def masker_kind_for(folder: str | Path) -> MaskerKind:
    """The kind that masks with the model in `folder`, or one message saying why none does."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise LabelModelError(f"{path} is not a folder", field="--model")
    for kind in kinds():
        if kind.takes(path):
            return kind
    known = "; ".join(f"{kind.name}: {kind.describes}" for kind in kinds())
    raise LabelModelError(f"{path} holds {_what_it_holds(path)}, which no masker takes; known kinds: {known}",
                          field="--model")


def _what_it_holds(path: Path) -> str:
    import json

    try:
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return "no model config"
    return f"a {model_type!r} model" if isinstance(model_type, str) else "no model config"
