"""Loss masks for a folder of images from a masker (modules/autolabel/maskers/: CLIPSeg from a text
prompt, or a background-removal model): its per-pixel probability at the image's size,
thresholded to white (train here) and black, and written atomically as
`<image stem>-masklabel.png`, the file masked training reads (modules/data/masks.py).

Modes: `overwrite` replaces a mask, `add` keeps what an existing mask marks and adds the new area
(a union: several prompts, one run each), `skip-existing` leaves an image with a mask alone."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from modules.autolabel.caption_folder import LabelReport, check_batch_size, check_mode, readable_batches
from modules.autolabel.images import mask_file
from modules.data.mask_files import mask_path
from modules.errors import UserError
from modules.util.atomic import write_with

MASK_MODES = ("overwrite", "add", "skip-existing")


def check_threshold(threshold: float) -> float:
    if not 0.0 <= threshold < 1.0:
        raise UserError(f"must be at least 0 and below 1, not {threshold}", field="--threshold")
    return threshold


def binary_mask(probability, threshold: float, expand: int = 0, existing=None):
    """A black-and-white PIL image: white where the probability is above `threshold`, grown by
    `expand` pixels; united with `existing` (an L image of the same size) where given."""
    import numpy as np
    from PIL import Image, ImageChops, ImageFilter

    mask = Image.fromarray(np.where(probability > threshold, 255, 0).astype(np.uint8), mode="L")
    if expand > 0:
        mask = mask.filter(ImageFilter.MaxFilter(2 * expand + 1))
    if existing is not None:
        mask = ImageChops.lighter(mask, existing.convert("L").point(lambda v: 255 if v >= 128 else 0))
    return mask


def _existing_mask(image: Path, size: tuple[int, int]):
    from PIL import Image

    path = mask_path(image)
    if path is None:
        return None
    try:
        with Image.open(path) as opened:
            return opened.convert("L").resize(size, Image.Resampling.NEAREST)
    except OSError:
        return None


def mask_images(images: list[Path], masker, prompt: str, threshold: float = 0.4, mode: str = "overwrite",
                expand: int = 0, batch_size: int = 4, on_progress: Callable = lambda report, path: None,
                on_warning: Callable[[str], None] = lambda message: None,
                stop_requested: Callable[[], bool] = lambda: False, takes_prompt: bool = True) -> LabelReport:
    """`prompt`: what to mask, for a masker that takes one (CLIPSeg; its kind's `takes_prompt`);
    else unused."""
    check_mode(mode, MASK_MODES), check_batch_size(batch_size), check_threshold(threshold)
    if takes_prompt and not prompt.strip():
        raise UserError("say what to mask (e.g. 'a person')", field="--prompt")
    report = LabelReport(total=len(images))
    skip = (lambda image: mask_path(image) is not None) if mode == "skip-existing" else (lambda image: False)
    for batch in readable_batches(images, batch_size, skip, report, on_progress, on_warning, stop_requested):
        for (image, pixels), probability in zip(batch, masker.probabilities([p for _, p in batch], prompt)):
            existing = _existing_mask(image, pixels.size) if mode == "add" else None
            mask = binary_mask(probability, threshold, expand, existing)
            write_with(mask_file(image), lambda temp, mask=mask: mask.save(temp, format="PNG"))
            report.written.append(image)
            on_progress(report, image)
    return report
