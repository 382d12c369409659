"""What a concept's folder holds, read the way training reads it (modules/data/pairs.py's scan:
plain images, or an edit concept's targets with their control images from sibling folders or a
manifest): the items with their captions, each image's size (from its header, EXIF rotation
applied), the aspect buckets they fall into, how many have no caption, and the samples training
skips (a control missing or unreadable). Runs on a worker thread (ui/background.py): a folder of a
thousand images takes a second or more to read."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from modules.config.train_config import CaptionConfig, ConceptConfig

ROTATED = {5, 6, 7, 8}  # EXIF orientations that swap width and height
# the scan's warning for a sample it leaves out (modules/data/pairs.py: a control missing or unreadable)
SKIPPED = re.compile(r"^concepts\[0\]: skipping sample (of )?(.*)$", re.DOTALL)


@dataclass
class ConceptSummary:
    items: list = field(default_factory=list)  # ConceptItem, in training's order
    problem: str | None = None  # why the folder cannot be read ("choose a folder", a path error)
    sizes: Counter = field(default_factory=Counter)  # (width, height) -> images
    buckets: Counter = field(default_factory=Counter)  # (width, height) -> images, per resolution
    unreadable: list = field(default_factory=list)  # image paths whose header cannot be read
    without_caption: int = 0
    skipped: list = field(default_factory=list)  # the scan's warnings: samples training leaves out, and why

    @property
    def controls(self) -> int:
        """Control images per sample (0: a plain image concept)."""
        return max((len(item.controls) for item in self.items), default=0)

    def count_text(self) -> str:
        if self.problem:
            return f"Preview: {self.problem}"
        if self.controls:  # an edit concept: a sample is a target with its controls
            each = f"{self.controls} control image{'s' if self.controls != 1 else ''}"
            return f"{len(self.items)} pair{'s' if len(self.items) != 1 else ''} (a target and {each} each)"
        return f"{len(self.items)} image{'s' if len(self.items) != 1 else ''}"

    def skipped_text(self) -> str:
        return f"{len(self.skipped)} skipped (see Statistics)" if self.skipped else ""

    def bucket_text(self) -> str:
        if not self.buckets:
            return ""
        return "Buckets: " + ", ".join(f"{w}x{h}: {n}" for (w, h), n in most_first(self.buckets))

    def stats_text(self) -> str:
        """Image count, sizes, buckets and captions missing, one per line."""
        if self.problem:
            return self.count_text()
        sizes = most_first(self.sizes)
        shown = ", ".join(f"{w}x{h}: {n}" for (w, h), n in sizes[:8]) + (f", … ({len(sizes) - 8} more sizes)"
                                                                        if len(sizes) > 8 else "")
        smallest = min(self.sizes, key=lambda s: s[0] * s[1]) if self.sizes else None
        lines = [self.count_text() + (f" ({len(self.unreadable)} unreadable)" if self.unreadable else ""),
                 f"Sizes: {shown or '-'}"]
        if smallest is not None:
            lines.append(f"Smallest: {smallest[0]}x{smallest[1]}")
        lines.append(self.bucket_text() or "Buckets: -")
        lines.append(f"Without a caption: {self.without_caption}")
        lines.extend(f"Skipped: {why}" for why in self.skipped[:5])
        if len(self.skipped) > 5:
            lines.append(f"… and {len(self.skipped) - 5} more skipped")
        return "\n".join(lines)


def most_first(counts: Counter) -> list:
    return sorted(counts.items(), key=lambda pair: (-pair[1], pair[0]))


def image_size(path) -> tuple[int, int]:
    """(width, height) as training sees it, from the header only."""
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
        orientation = image.getexif().get(0x0112)
    return (height, width) if orientation in ROTATED else (width, height)


def bucket_quantum(family: str | None) -> int | None:
    """The family's bucket side multiple, None for a name that is no family (its class imports torch:
    asked on the worker thread)."""
    from modules.config.families import family_names, get_family_declaration

    return get_family_declaration(family).bucket_quantum if family in family_names() else None


def summarize(concept: dict, data: dict, family: str | None) -> ConceptSummary:
    """The summary of one concept dict (as the config holds it), with the data settings and family
    that decide its buckets."""
    from pydantic import ValidationError

    from modules.config.train_config import DataConfig
    from modules.data.buckets import bucket_for
    from modules.data.concepts import DataError
    from modules.data.pairs import scan_items

    if not str(concept.get("path") or "").strip():
        return ConceptSummary(problem="choose a folder")
    warnings: list[str] = []
    try:  # training's own scan: a paired concept's targets with their controls, not its folders' files
        items = scan_items(0, ConceptConfig.model_validate(concept), warnings.append)
    except (ValidationError, DataError, OSError) as error:
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        return ConceptSummary(problem=text.replace("concepts[0].", "").replace("concepts[0]: ", ""))
    summary = ConceptSummary(items=items, without_caption=sum(not item.caption.strip() for item in items),
                             skipped=[m.group(2) for why in warnings if (m := SKIPPED.match(why))])
    try:  # the data settings as they are now (the whole config may not validate while being edited)
        settings = DataConfig.model_validate(data or {})
    except ValidationError:
        settings = None
    quantum = bucket_quantum(family)
    for item in items:
        try:
            size = image_size(item.image)
        except OSError:
            summary.unreadable.append(item.image)
            continue
        summary.sizes[size] += 1
        if settings is not None and quantum is not None:
            for resolution in settings.resolutions:
                summary.buckets[bucket_for(*size, resolution, quantum, settings.aspect_buckets)] += 1
    return summary


def trained_caption(caption: str, concept: dict, position: int, seed: int) -> str:
    """The caption as the trainer uses it in epoch 1 (prefix, suffix, shuffle and dropout drawn)."""
    from modules.data.captions import caption_rng, varied_caption

    try:
        options = CaptionConfig.model_validate(concept.get("captions") or {})
    except ValueError:
        return caption
    return varied_caption(caption, options, caption_rng(seed, 0, 0, position))
