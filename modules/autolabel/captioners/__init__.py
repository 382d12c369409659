"""Captioner kinds: one file each in this folder, declaring which model configs it takes.

A kind is a `CaptionerKind` registered with `register`; `captioner_for(folder)` asks each kind in
`order` whether it takes the folder's config.json (its `model_type`, `architectures`, the files
beside it) and loads the first that does; a kind of its own folder layout (`needs_config` False,
such as a WD14 tagger's ONNX file and tag table) is told by its files alone. Nothing here knows a
kind or a model by name: a new kind is a new file."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from modules.autolabel.model_folder import LabelModelError, model_config


class Captioner(Protocol):
    def caption(self, images: list, prompts: list[str], max_new_tokens: int) -> list[str]:
        """One caption per image (PIL RGB images), each from its prompt ("" where the kind takes none)."""


@dataclass(frozen=True)
class CaptionerKind:
    name: str
    describes: str  # what it takes, for the message when no kind does
    takes: Callable[[dict, Path], bool]  # (config.json, folder) -> whether this kind captions with it
    load: Callable[..., Captioner]  # (folder, device, dtype) -> a ready captioner
    default_prompt: str = ""  # the prompt when the user gives none
    order: int = 100  # lower is asked first: a kind for a few model types before a general one
    needs_config: bool = True  # False: a folder of its own layout (no transformers config.json), told by its files


_KINDS: dict[str, CaptionerKind] = {}


def register(kind: CaptionerKind) -> CaptionerKind:
    _KINDS[kind.name] = kind
    return kind


def kinds() -> list[CaptionerKind]:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return sorted(_KINDS.values(), key=lambda kind: (kind.order, kind.name))


def kind_for(folder: str | Path) -> CaptionerKind:
    """The kind that captions with the model in `folder`, or one message saying why none does."""
    for kind in kinds():  # the kinds of their own layouts first: their folders have no transformers config
        if not kind.needs_config and kind.takes({}, Path(folder).expanduser()):
            return kind
    config = model_config(folder)
    for kind in kinds():
        if kind.takes(config, Path(folder)):
            return kind
    known = "; ".join(f"{kind.name}: {kind.describes}" for kind in kinds())
    architectures = ", ".join(config.get("architectures") or []) or "none named"
    raise LabelModelError(f"{folder}: no captioner takes a {config['model_type']!r} model (architectures: "
                          f"{architectures}); known kinds: {known}", field="--model")


def captioner_for(folder: str | Path, device: str = "cpu", dtype: str = "float32") -> Captioner:
    return kind_for(folder).load(Path(folder), device, dtype)
