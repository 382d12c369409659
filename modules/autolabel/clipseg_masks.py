"""Loss masks from a text prompt with CLIPSeg (CLIPSegForImageSegmentation): the model's per-pixel
probability that the prompt is there, brought up to the image's size, thresholded to white (train
here) and black, and written atomically as `<image stem>-masklabel.png`, the file masked training
reads (modules/data/masks.py).

Modes: `overwrite` replaces a mask, `add` keeps what an existing mask marks and adds the new area
(a union: several prompts, one run each), `skip-existing` leaves an image with a mask alone."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from modules.autolabel.caption_folder import LabelReport, check_batch_size, check_mode, readable_batches
from modules.autolabel.images import mask_file
from modules.autolabel.model_folder import LabelModelError, model_config
from modules.autolabel.transformers_models import load_model, load_pretrained, model_inputs
from modules.data.mask_files import mask_path
from modules.errors import UserError
from modules.util.atomic import write_with

MASK_MODES = ("overwrite", "add", "skip-existing")


def check_clipseg_folder(folder: str | Path) -> Path:
    """The folder, if it holds a CLIPSeg model; else one message naming it (read without torch)."""
    folder = Path(folder)
    config = model_config(folder)
    if config["model_type"] != "clipseg":
        raise LabelModelError(f"{folder} holds a {config['model_type']!r} model; masks are made with CLIPSeg "
                              "(model_type clipseg, CLIPSegForImageSegmentation)", field="--model")
    return folder


class ClipSegMasker:
    def __init__(self, folder: str | Path, device: str = "cpu", dtype: str = "float32"):
        folder = check_clipseg_folder(folder)
        from transformers import AutoProcessor, CLIPSegForImageSegmentation

        self.processor = load_pretrained(AutoProcessor, folder, "processor")
        self.model = load_model(CLIPSegForImageSegmentation, folder, device, dtype)

    def probabilities(self, images: list, prompt: str) -> list:
        """Per image, an (height, width) float array in [0, 1] at the image's own size."""
        import numpy as np
        import torch
        import torch.nn.functional as F

        batch = self.processor(text=[prompt] * len(images), images=images, return_tensors="pt", padding=True)
        with torch.inference_mode():
            logits = self.model(**model_inputs(batch, self.model)).logits
        logits = logits.float().reshape(len(images), 1, *logits.shape[-2:])  # (a batch of one comes squeezed)
        maps = []
        for image, image_logits in zip(images, logits):
            resized = F.interpolate(image_logits[None], size=(image.height, image.width), mode="bilinear",
                                    align_corners=False)[0, 0]
            maps.append(np.asarray(torch.sigmoid(resized).cpu()))
        return maps


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
                stop_requested: Callable[[], bool] = lambda: False) -> LabelReport:
    check_mode(mode, MASK_MODES), check_batch_size(batch_size), check_threshold(threshold)
    if not prompt.strip():
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
