"""Read an image and bring it to its bucket: resize to cover, then center-crop.

Every mode Pillow opens is brought to 8-bit RGB (or L for masks) by what it means, not by
Pillow's clipping convert: 16- and 32-bit integer grey (`I;16`, `I`: a 16-bit PNG or TIFF) is
scaled from 0..65535 (a plain convert clips it to white), and transparency (RGBA, LA, PA, a
palette or grey image with a transparent colour) is composited on white, as image viewers show it,
instead of being dropped (which leaves whatever colour the transparent pixels happen to hold).
"""

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


# what transparent pixels become in training images (docs/data.md)
ALPHA_BACKGROUND = (255, 255, 255)
_WIDE_GREY = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def _wide_grey_to_l(image: Image.Image) -> Image.Image:
    """An integer (or float) grey image scaled from the 16-bit range to 8 bits."""
    array = np.asarray(image, dtype=np.float64)
    scaled = np.clip(np.rint(array / 257.0), 0, 255).astype(np.uint8)  # 65535 / 255 = 257
    return Image.fromarray(scaled, "L")


def _has_alpha(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info


def to_mode(image: Image.Image, mode: str) -> Image.Image:
    """`image` in "RGB" (transparency composited on ALPHA_BACKGROUND) or "L", for any mode Pillow reads."""
    if image.mode in _WIDE_GREY:
        image = _wide_grey_to_l(image)
    if mode == "RGB" and _has_alpha(image):
        background = Image.new("RGBA", image.size, (*ALPHA_BACKGROUND, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image if image.mode == mode else image.convert(mode)


def open_covering(path: Path, mode: str, width: int, height: int, position: tuple[float, float],
                  resample: Image.Resampling) -> Image.Image:
    """The image file (EXIF-rotated, in `mode`) resized to cover width x height and cropped at `position`."""
    with Image.open(path) as opened:
        image = to_mode(ImageOps.exif_transpose(opened), mode)
    image = image.resize(cover_size(image.size, width, height), resample)
    return image.crop(crop_box(image.size, width, height, position))


def load_cropped(path: Path, width: int, height: int, position: tuple[float, float] = (0.5, 0.5)) -> torch.Tensor:
    """(3, height, width) float tensor in [-1, 1]: resized to cover, cropped at `position`."""
    image = open_covering(path, "RGB", width, height, position, Image.Resampling.LANCZOS)
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()
