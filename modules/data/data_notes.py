"""Warnings about a scanned data set that trains, but not as the user may think: a resolution the
family's bucket step changes, images enlarged far past their size, captions the text encoder cuts,
images that two concepts both hold. Each is said once, with a count and an example, never per file.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from modules.data.dataset import Entry
    from modules.model.base import ModelFamily

UPSCALE_LIMIT = 2.0  # an image enlarged more than this (each side) trains visibly blurry


def resolution_notes(resolutions: list[int], quantum: int, label: str) -> list[str]:
    """Each resolution that buckets change: below the step it trains at the step (and shares its
    cache), between steps square images train at the step below."""
    notes = []
    for resolution in resolutions:
        if resolution < quantum:
            notes.append(f"data.resolution: {resolution} is below {label}'s bucket step of {quantum} px; images "
                         f"train at {quantum}x{quantum} (the same latents, and cache entries, as resolution {quantum})")
        elif resolution % quantum:
            side = resolution // quantum * quantum
            notes.append(f"data.resolution: {resolution} is not a multiple of {label}'s bucket step of {quantum} px; "
                         f"square images train at {side}x{side}")
    return notes


def one_frame_notes(entries: list[Entry], family: ModelFamily, where: Callable[[int], str]) -> list[str]:
    """Per concept: how many samples are one frame (still images, one-frame clips) where the family
    says what such a sample trains (`one_frame_note`: an image-to-video model's is its own condition)."""
    if not family.one_frame_note:
        return []
    by_concept: dict[int, list[Entry]] = defaultdict(list)
    for entry in entries:
        if entry.clip is None or entry.clip.frames == 1:
            by_concept[entry.item.concept].append(entry)
    return [f"{where(concept)}: {len(found)} one-frame sample(s) (still images or one-frame clips, e.g. "
            f"{found[0].item.image.name}): {family.one_frame_note}" for concept, found in sorted(by_concept.items())]


def _upscale(entry: Entry) -> float:
    width, height = entry.original_size
    return max(entry.bucket[0] / width, entry.bucket[1] / height)


def upscale_notes(entries: list[Entry], where: Callable[[int], str]) -> list[str]:
    """Per concept: how many images are enlarged more than UPSCALE_LIMIT to cover their bucket."""
    enlarged: dict[int, dict[Path, Entry]] = defaultdict(dict)
    for entry in entries:
        if entry.original_size and _upscale(entry) > UPSCALE_LIMIT:
            enlarged[entry.item.concept].setdefault(entry.item.image, entry)
    notes = []
    for concept, images in sorted(enlarged.items()):
        example = next(iter(images.values()))
        width, height = example.original_size
        notes.append(f"{where(concept)}: {len(images)} image(s) are smaller than half their training size and will "
                     f"be upscaled (e.g. {example.item.image.name}: {width}x{height} to {example.bucket[0]}x"
                     f"{example.bucket[1]}); they train blurry: use larger images or a lower data.resolution")
    return notes


def caption_notes(entries: list[Entry], family: ModelFamily, where: Callable[[int], str]) -> list[str]:
    """Per concept: how many captions are longer than a window the family's text encoder cuts them to."""
    windows = family.caption_windows()
    if not windows:
        return []
    captions: dict[int, dict[Path, str]] = defaultdict(dict)
    for entry in entries:
        if entry.item.caption:
            captions[entry.item.concept].setdefault(entry.item.image, entry.item.caption)
    notes = []
    for concept, by_image in sorted(captions.items()):
        images, texts = list(by_image), list(by_image.values())
        for tokenizer, window in windows:
            lengths = [len(ids) for ids in tokenizer(texts, truncation=False).input_ids]
            over = [(image, length) for image, length in zip(images, lengths) if length > window]
            if over:
                image, length = max(over, key=lambda pair: pair[1])
                notes.append(f"{where(concept)}: {len(over)} caption(s) are longer than the text encoder's "
                             f"{window}-token window and are cut to it (e.g. {image.name}: {length} tokens); "
                             "put what matters first, or shorten them")
                break  # one window's count says it; a second tokenizer would repeat it
    return notes


def duplicate_notes(entries: list[Entry], where: Callable[[int], str]) -> list[str]:
    """Images that several concepts hold (the same folder given twice, or a folder and its subfolder
    with include_subfolders): each trains once per concept, every epoch."""
    holders: dict[Path, set[int]] = defaultdict(set)
    for entry in entries:
        holders[entry.item.image.resolve()].add(entry.item.concept)
    shared: dict[tuple[int, ...], list[Path]] = defaultdict(list)
    for image, concepts in holders.items():
        if len(concepts) > 1:
            shared[tuple(sorted(concepts))].append(image)
    notes = []
    for concepts, images in sorted(shared.items()):
        names = " and ".join(where(c) for c in concepts)
        notes.append(f"{names} hold the same {len(images)} image(s) (e.g. {images[0]}): each trains "
                     f"{len(concepts)} times per epoch; remove the duplicate concept, or weight a folder "
                     "with its repeats")
    return notes
