"""Pixel augmentations drawn anew each time an image is trained (so its latents are encoded then,
not cached): a random crop position and colour jitter (brightness, contrast, saturation)."""

from __future__ import annotations

import random

import torch


def crop_position(rng: random.Random, enabled: bool) -> tuple[float, float]:
    return (rng.random(), rng.random()) if enabled else (0.5, 0.5)


def color_jitter(pixels: torch.Tensor, strength: float, rng: random.Random) -> torch.Tensor:
    """(3, H, W) in [-1, 1] -> the same with brightness, contrast and saturation each moved by up
    to +-strength (multiplicative for contrast and saturation), clamped to the range."""
    if strength <= 0:
        return pixels
    brightness = rng.uniform(-strength, strength)
    contrast = 1 + rng.uniform(-strength, strength)
    saturation = 1 + rng.uniform(-strength, strength)
    image = (pixels + 1) / 2 + brightness
    image = (image - image.mean()) * contrast + image.mean()
    gray = (0.299 * image[0] + 0.587 * image[1] + 0.114 * image[2]).expand_as(image)
    image = gray + (image - gray) * saturation
    return (image.clamp(0, 1) * 2 - 1).contiguous()
