"""Read an image and bring it to its bucket: resize to cover, then center-crop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) after EXIF rotation, reading only the header."""
    with Image.open(path) as image:
        width, height = image.size
        orientation = image.getexif().get(0x0112, 1)
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def crop_box(size: tuple[int, int], width: int, height: int,
             position: tuple[float, float] = (0.5, 0.5)) -> tuple[int, int, int, int]:
    """The (left, top, right, bottom) crop of an image already resized to cover width x height;
    `position` places it in the spare border (0.5, 0.5: centred)."""
    left = round((size[0] - width) * position[0])
    top = round((size[1] - height) * position[1])
    return left, top, left + width, top + height


def cover_size(size: tuple[int, int], width: int, height: int) -> tuple[int, int]:
    """The size an image of `size` is resized to so that it covers width x height."""
    scale = max(width / size[0], height / size[1])
    return max(width, round(size[0] * scale)), max(height, round(size[1] * scale))


def crop_origin(size: tuple[int, int], width: int, height: int,
                position: tuple[float, float] = (0.5, 0.5)) -> tuple[int, int]:
    """(top, left) of the crop load_cropped takes from an image of `size`, in the resized image's
    pixels (what SDXL's crop conditioning means)."""
    left, top, _, _ = crop_box(cover_size(size, width, height), width, height, position)
    return top, left


def open_covering(path: Path, mode: str, width: int, height: int, position: tuple[float, float],
                  resample: Image.Resampling) -> Image.Image:
    """The image file (EXIF-rotated, in `mode`) resized to cover width x height and cropped at `position`."""
    with Image.open(path) as opened:
        image = ImageOps.exif_transpose(opened).convert(mode)
    image = image.resize(cover_size(image.size, width, height), resample)
    return image.crop(crop_box(image.size, width, height, position))


def load_cropped(path: Path, width: int, height: int, position: tuple[float, float] = (0.5, 0.5)) -> torch.Tensor:
    """(3, height, width) float tensor in [-1, 1]: resized to cover, cropped at `position`."""
    image = open_covering(path, "RGB", width, height, position, Image.Resampling.LANCZOS)
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()
