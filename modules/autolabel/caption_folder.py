"""Caption every image of a folder: batches through a captioner, each caption written atomically
to `<image>.txt` as soon as its batch is done, so a run stopped between batches leaves the captions
written so far whole and no file half-written.

Modes: `overwrite` replaces a caption, `append` adds the new one after it (", " between), and
`skip-existing` leaves an image with a non-empty caption alone. A stop request is honoured between
batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from modules.autolabel.images import caption_file, read_caption
from modules.autolabel.prompt_template import fill
from modules.errors import UserError
from modules.util.atomic import write_text

MODES = ("overwrite", "append", "skip-existing")
APPEND_SEPARATOR = ", "


@dataclass
class LabelReport:
    """What a labelling run did, counted per image."""

    total: int
    written: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)  # skip-existing: already labelled
    failed: list[Path] = field(default_factory=list)  # unreadable, or the model gave nothing
    stopped: bool = False

    @property
    def done(self) -> int:
        return len(self.written) + len(self.skipped) + len(self.failed)

    def summary(self, what: str = "captions") -> str:
        stopped = f", stopped after {self.done} of {self.total} images" if self.stopped else ""
        return (f"{len(self.written)} {what} written, {len(self.skipped)} kept, "
                f"{len(self.failed)} failed{stopped}")


def check_mode(mode: str, modes=MODES) -> str:
    if mode not in modes:
        raise UserError(f"unknown mode {mode!r} (known: {', '.join(modes)})", field="--mode")
    return mode


def check_batch_size(batch_size: int) -> int:
    if batch_size < 1:
        raise UserError(f"the batch size must be at least 1, not {batch_size}", field="--batch-size")
    return batch_size


def open_rgb(image: Path):
    """The image as RGB, or None when it cannot be read."""
    from PIL import Image

    try:
        with Image.open(image) as opened:
            return opened.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError):
        return None


def new_caption(existing: str, generated: str, mode: str) -> str:
    if mode == "append" and existing:
        return existing + APPEND_SEPARATOR + generated
    return generated


def readable_batches(images: list[Path], batch_size: int, skip: Callable[[Path], bool], report: LabelReport,
                     on_progress: Callable, on_warning: Callable[[str], None], stop_requested: Callable[[], bool]):
    """Batches of (image, RGB picture) to label, for the caption and mask commands alike: images
    `skip` says are done and unreadable ones are recorded in `report` (and reported) on the way;
    a stop ends it between batches (`report.stopped`)."""
    todo = []
    for image in images:
        if skip(image):
            report.skipped.append(image)
            on_progress(report, image)
        else:
            todo.append(image)
    for start in range(0, len(todo), batch_size):
        if stop_requested():
            report.stopped = True
            return
        batch = []
        for image in todo[start:start + batch_size]:
            pixels = open_rgb(image)
            if pixels is None:
                report.failed.append(image)
                on_warning(f"{image}: not a readable image, skipped")
                on_progress(report, image)
            else:
                batch.append((image, pixels))
        if batch:
            yield batch


def caption_images(images: list[Path], captioner, template: str, mode: str = "overwrite", batch_size: int = 4,
                   max_new_tokens: int = 60, on_progress: Callable[[LabelReport, Path], None] = lambda r, p: None,
                   on_warning: Callable[[str], None] = lambda message: None,
                   stop_requested: Callable[[], bool] = lambda: False) -> LabelReport:
    check_mode(mode), check_batch_size(batch_size)
    report = LabelReport(total=len(images))
    skip = (lambda image: bool(read_caption(image))) if mode == "skip-existing" else (lambda image: False)
    for pairs in readable_batches(images, batch_size, skip, report, on_progress, on_warning, stop_requested):
        batch = [(image, pixels, read_caption(image)) for image, pixels in pairs]
        prompts = [fill(template, image, existing) for image, _, existing in batch]
        captions = captioner.caption([pixels for _, pixels, _ in batch], prompts, max_new_tokens)
        for (image, _, existing), caption in zip(batch, captions):
            if not caption:
                report.failed.append(image)
                on_warning(f"{image}: the model gave an empty caption; {caption_file(image).name} left as it was")
            else:
                write_text(caption_file(image), new_caption(existing, caption, mode) + "\n")
                report.written.append(image)
            on_progress(report, image)
    return report
