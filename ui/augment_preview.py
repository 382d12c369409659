"""The augmentation preview: one image as training draws it, through the data settings' crop,
flip and colour jitter, with the trainer's own functions (modules/data/augment.py and
modules/data/images.py's crop) in the order FreshLatents.load applies them. An edit pair's
control images are drawn beside their target through modules/data/pairs.fresh_controls, as
training draws them: the target's crop, mirror and colour draws. Runs on a worker thread (it
imports torch on first use)."""

from __future__ import annotations

import random
from pathlib import Path

DRAWS = 4  # tiles shown; with flip on, every second one is mirrored (training mirrors half of the time)


def data_setting(data: dict, name: str):
    """A data.* value as the config holds it, else the schema's default (the preview follows the
    settings while the whole config may not validate: crop_jitter on with cache_latents still on)."""
    from modules.config.train_config import DataConfig

    value = (data or {}).get(name)
    return DataConfig.model_fields[name].default if value is None else value


def preview_bucket(image: Path, data: dict, quantum: int) -> tuple[int, int]:
    """The bucket the image trains at, at the first resolution."""
    from modules.data.buckets import bucket_for
    from modules.data.images import image_size

    resolution = data_setting(data, "resolution")
    resolution = int(resolution[0] if isinstance(resolution, list) else resolution)
    return bucket_for(*image_size(image), resolution, quantum, bool(data_setting(data, "aspect_buckets")))


def augmented_draws(image: Path, data: dict, family: str | None, seed: int, count: int = DRAWS,
                    controls: tuple = ()) -> list:
    """`count` PIL images of `image` at its bucket (for `family`'s quantum), each drawn as a training
    step would draw it; with `controls` (an edit pair's control images), each draw is the target
    with its controls to its right, in order."""
    import torch
    from PIL import Image

    from modules.data.augment import color_jitter, crop_position
    from modules.data.images import load_cropped
    from modules.data.pairs import fresh_controls
    from ui.concept_stats import bucket_quantum

    width, height = preview_bucket(image, data, bucket_quantum(family) or 64)
    crop, flip = bool(data_setting(data, "crop_jitter")), bool(data_setting(data, "flip"))
    jitter = float(data_setting(data, "color_jitter") or 0)
    rng = random.Random(seed)
    draws = []
    for index in range(count):
        position, mirrored = crop_position(rng, crop), flip and index % 2 == 1
        pixels = load_cropped(image, width, height, position)
        if mirrored:
            pixels = pixels.flip(-1)
        state = rng.getstate()  # the controls replay the target's colour draws, as training does
        pixels = color_jitter(pixels, jitter, rng)
        drawn = fresh_controls(list(controls), width, height, position, mirrored, jitter, rng, state)
        if drawn is not None:
            pixels = torch.cat([pixels, *drawn], dim=-1)
        array = ((pixels + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0).numpy()
        draws.append(Image.fromarray(array, "RGB"))
    return draws


def settings_text(data: dict) -> str:
    parts = [f"crop {'at a random position' if data_setting(data, 'crop_jitter') else 'centred'}",
             "mirrored half of the time (tiles 2 and 4)" if data_setting(data, "flip") else "not mirrored",
             f"colour jitter {float(data_setting(data, 'color_jitter') or 0):g}"]
    return "As training draws it (data settings, Training tab): " + "; ".join(parts) + "."
