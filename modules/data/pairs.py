"""Paired samples for edit models: a target image, 1..N control (reference) images and a caption
(the edit instruction), from a concept whose `controls.source` is `folders` or `manifest`.

folders: `<concept>/target/` holds the targets (captions beside them, as `caption_source` says)
and `control/`, `control_2/`, ... the controls, matched to a target by file stem. manifest: a
JSON Lines file, one `{"target": ..., "control": [...], "caption": ...}` per line, paths relative
to the manifest's folder. A sample whose control is missing or unreadable is skipped with a
warning naming it; a manifest line that is not such a record is an error naming its line.

Controls train at their target's bucket (resized to cover it and centre-cropped as the target),
mirrored whenever the target is, and are cached like targets: one latent cache entry per control
image and bucket, keyed by its content, so a control shared by several targets is encoded once.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from modules.config.control_config import ControlConfig
from modules.config.train_config import ConceptConfig
from modules.data.cache import cache_key
from modules.data.concepts import IMAGE_SUFFIXES, ConceptItem, DataError, scan_concept
from modules.data.augment import color_jitter
from modules.data.images import image_size, load_cropped, open_covering

if TYPE_CHECKING:
    from modules.config.train_config import TrainConfig
    from modules.data.dataset import Entry
    from modules.model.base import ModelFamily

_CONTROL_FOLDER = re.compile(r"^control(?:_(\d+))?$")
_RECORD_KEYS = {"target", "control", "caption"}


def scan_items(index: int, concept: ConceptConfig, warn: Callable[[str], None]) -> list[ConceptItem]:
    """The concept's samples: plain images (scan_concept), or targets with their controls."""
    source = concept.controls.source
    if source == "folders":
        return _scan_folders(index, concept, warn)
    if source == "manifest":
        return _scan_manifest(index, concept, warn)
    return scan_concept(index, concept, warn)


def control_folders(folder: Path) -> list[Path]:
    """`control/`, `control_2/`, ... in the concept folder, in their order (control/ is the first)."""
    found = [(int(m.group(1) or 1), p) for p in folder.iterdir()
             if p.is_dir() and (m := _CONTROL_FOLDER.match(p.name))]
    return [p for _, p in sorted(found)]


def _scan_folders(index: int, concept: ConceptConfig, warn: Callable[[str], None]) -> list[ConceptItem]:
    where = f"concepts[{index}]"
    folder = Path(concept.path)
    target = folder / "target"
    if not target.is_dir():
        raise DataError(f"{where}.controls.source: 'folders' reads the targets from {target}, which is not a folder")
    folders = control_folders(folder)
    if not folders:
        raise DataError(f"{where}.controls.source: 'folders' reads the controls from {folder / 'control'} "
                        "(and control_2/, ...), which is not there")
    stems = [{p.stem: p for p in sorted(f.iterdir(), reverse=True) if p.suffix.lower() in IMAGE_SUFFIXES}
             for f in folders]
    targets = scan_concept(index, concept.model_copy(update={"path": str(target), "controls": ControlConfig()}), warn)
    items = []
    for item in targets:
        found = [by_stem.get(item.image.stem) for by_stem in stems]
        absent = [str(f) for f, path in zip(folders, found) if path is None]
        if absent:
            warn(f"{where}: skipping sample {item.image}: no control image {item.image.stem}.* in {', '.join(absent)}")
            continue
        if _readable(where, item.image, found, warn):
            items.append(replace(item, controls=tuple(found)))
    return items


def _scan_manifest(index: int, concept: ConceptConfig, warn: Callable[[str], None]) -> list[ConceptItem]:
    where = f"concepts[{index}].controls.manifest"
    path = Path(concept.path) / concept.controls.manifest
    if not path.is_file():
        raise DataError(f"{where}: {path} not found")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError:
        raise DataError(f"{where}: {path} is not UTF-8 text") from None
    items = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: {path} line {number} is not JSON ({error.msg}, column {error.colno})") from None
        target, controls, caption = _record(record, f"{where}: {path} line {number}")
        target, controls = path.parent / target, tuple(path.parent / c for c in controls)
        missing = [str(p) for p in (target, *controls) if not p.is_file()]
        if missing:
            warn(f"concepts[{index}]: skipping sample of {path} line {number}: {', '.join(missing)} not found")
            continue
        if _readable(f"concepts[{index}]", target, controls, warn):
            items.append(ConceptItem(target, caption, index, controls))
    return items


def _record(record: object, where: str) -> tuple[str, list[str], str]:
    """(target, controls, caption) of one manifest line, or a DataError saying what is wrong with it."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object like {{\"target\": ..., \"control\": [...], \"caption\": ...}}")
    unknown = sorted(set(record) - _RECORD_KEYS)
    if unknown:
        raise DataError(f"{where}: unknown key {unknown[0]!r} (keys: target, control, caption)")
    target, controls, caption = record.get("target"), record.get("control"), record.get("caption", "")
    if not isinstance(target, str) or not target:
        raise DataError(f"{where}: \"target\" must be an image path")
    controls = [controls] if isinstance(controls, str) else controls
    if not isinstance(controls, list) or not controls or not all(isinstance(c, str) and c for c in controls):
        raise DataError(f"{where}: \"control\" must be an image path or a non-empty list of them")
    if not isinstance(caption, str):
        raise DataError(f"{where}: \"caption\" must be text")
    return target, controls, caption.strip()


def _readable(where: str, target: Path, controls, warn: Callable[[str], None]) -> bool:
    for control in controls:
        try:
            image_size(control)
        except Exception as error:  # PIL raises many kinds for a broken file
            warn(f"{where}: skipping sample {target}: unreadable control image {control}: {error}")
            return False
    return True


def check_controls(config: TrainConfig, family: ModelFamily, concepts) -> None:
    """Before scanning: paired concepts need a family that takes control images."""
    paired = [(i, c) for i, c in concepts if c.controls.source != "none"]
    if not paired:
        return
    index = paired[0][0]
    if family.control_images == 0 and family.prompt_images[1] > 0:
        raise DataError(f"concepts[{index}].controls.source: {family.label} takes control images in sample "
                        "prompts only (sampling.prompts[].control_images), not in training samples")
    if family.control_images == 0:
        raise DataError(f"concepts[{index}].controls.source: {family.label} takes no control images "
                        "(model.family: choose an edit model, such as flux_kontext)")


def attach_controls(entries: list[Entry], family: ModelFamily, image_identity: str, where) -> list[Entry]:
    """Set each paired entry's control_keys; the control images as entries of their own (at their
    target's bucket and flip, no mask) for the latent cache to fill. All samples must carry the
    same number of controls (a batch stacks them), at most what the family takes."""
    counts = {len(e.item.controls) for e in entries}
    if len(counts) > 1:
        plain = next((e for e in entries if not e.item.controls), None)
        if plain is not None:
            raise DataError(f"{where(plain.item.concept)}: {plain.item.image} has no control image while other "
                            "samples do; train plain images and edit pairs in separate runs")
        few = min(counts)
        odd = next(e for e in entries if len(e.item.controls) == few)
        raise DataError(f"{where(odd.item.concept)}: {odd.item.image} has {few} control image(s), other samples "
                        f"{max(counts)}; every sample of a run needs the same number")
    count = counts.pop() if counts else 0
    if count == 0:
        return []
    if count > family.control_images:
        first = entries[0]
        raise DataError(f"{where(first.item.concept)}: {first.item.image} has {count} control images; "
                        f"{family.label} takes at most {family.control_images} per sample")
    digests: dict[Path, str] = {}
    controls: dict[str, Entry] = {}
    for entry in entries:
        keys = []
        for path in entry.item.controls:
            if path not in digests:
                digests[path] = hashlib.sha1(path.read_bytes()).hexdigest()
            # the key a target image of these contents gets at this bucket: shared when one is both
            key = cache_key("latent", digests[path], entry.bucket, image_identity, "center-crop", "",
                            "flip" if entry.flip else "")
            keys.append(key)
            controls.setdefault(key, replace(entry, item=ConceptItem(path, "", entry.item.concept), latent_key=key,
                                             mask=None, control_keys=()))
        entry.control_keys = tuple(keys)
        if family.text_sees_controls and entry.text_key is not None:
            # the conditioning of this caption with these controls at this bucket (mirrored: its own entry)
            seen = [digests[path] for path in entry.item.controls]
            entry.text_key = cache_key("text", entry.text_key, entry.bucket, *seen)
            entry.flipped_text_key = cache_key("text", entry.text_key, "flip") if entry.flip else None
    return list(controls.values())


def text_controls(entry: Entry, mirrored: bool) -> list:
    """The control images of `entry` as a text encoder that sees them is shown them: PIL images at
    the entry's bucket, covered and centre-cropped as their latents are, mirrored with the target
    (what the text cache encodes, and what a step that encodes the text itself is handed)."""
    from PIL import Image, ImageOps

    width, height = entry.bucket
    images = [open_covering(path, "RGB", width, height, (0.5, 0.5), Image.Resampling.LANCZOS)
              for path in entry.item.controls]
    return [ImageOps.mirror(image) for image in images] if mirrored else images


def drop_unready(entries: list[Entry], ready: set[str], warn: Callable[[str], None]) -> list[Entry]:
    """The entries whose target and controls all have latents (an unreadable control skips its sample)."""
    kept = []
    for entry in entries:
        if entry.latent_key in ready and not all(k in ready for k in entry.control_keys):
            warn(f"skipping sample {entry.item.image}: a control image of it could not be read")
            continue
        kept.append(entry)
    return [e for e in kept if e.latent_key in ready]


def fresh_controls(paths, width: int, height: int, position, flip: bool, strength: float, rng, state):
    """(N, 3, height, width) control pixels augmented as their target was (data.cache_latents off):
    the same crop position and mirror, and the same colour draws (`rng` replayed from `state`, the
    stream before the target's colour jitter, and left where the target's jitter left it); None
    for a plain image."""
    if not paths:
        return None
    after, controls = rng.getstate(), []
    for path in paths:
        rng.setstate(state)
        image = load_cropped(path, width, height, position)
        controls.append(color_jitter(image.flip(-1) if flip else image, strength, rng))
    rng.setstate(after)
    return torch.stack(controls)
