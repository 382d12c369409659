"""The largest values the config accepts for sizes, counts, seeds and scales.

Each limit is far beyond what a real run uses, and low enough that a typo (an extra zero or
three) is refused by validation, naming the field and the limit, instead of filling the disk or
RAM (issue 26: `data.resolution=1000000` cached 18.6 GB before the kernel killed the run). Bounds
also refuse NaN and infinity, which compare false with any limit.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

# pixels per side of a training image or a sample; no family here trains above 2048
MAX_RESOLUTION = 4096
# seeds as A1111, ComfyUI's UI and numpy take them (0 .. 2**32 - 1)
MAX_SEED = 2**32 - 1
# denoising steps of one sample (samples use 20-50): the DDPM families have 1000 timesteps, and
# DDIM's spacing (with its offset of 1) asks for timestep 1000 when given 1000 steps
MAX_SAMPLE_STEPS = 500
MAX_GUIDANCE = 100.0
# counts of steps, epochs and what repeats them
MAX_STEPS = 100_000_000
MAX_EPOCHS = 100_000
MAX_REPEATS = 10_000  # kohya's folder repeats are 1..100 in practice
MAX_SAMPLES_PER_EPOCH = 10_000_000
MAX_BATCH = 1024  # images per forward pass, and batches per optimizer step
# what `schedule.batch_size: auto` picks from (the plan's largest that fits; the sizes LoRA users train at)
AUTO_BATCH_SIZES = (1, 2, 4, 8)
MAX_BACKUPS = 10_000
MAX_TAGS = 10_000
# adapter sizes: above the smaller side of every layer of every family here (FLUX.2 dev: 6144)
MAX_RANK = 8192
MAX_ALPHA = 65_536.0
# scales
MAX_LEARNING_RATE = 10.0  # Prodigy and D-Adaptation take ~1.0; AdamW ~1e-4
MAX_WEIGHT_DECAY = 10.0
MAX_EPSILON = 1.0
MAX_LOSS_WEIGHT = 1000.0
MAX_GRAD_NORM = 1e6
MAX_CACHE_MB = 1024.0 * 1024.0  # 1 TiB of cached tensors in RAM


def single_message(text: str):
    """A wrap validator for a field that is a union (a number or a list, a number or 'auto'): one
    message saying what is accepted, instead of pydantic's one line per member of the union."""

    def validate(value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"{text} (got {value!r})") from None

    return validate
# images in one epoch, repeats and resolutions counted (each is an entry of the epoch's order list)
MAX_EPOCH_IMAGES = 10_000_000
