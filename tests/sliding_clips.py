"""A tiny video concept for the image-to-video family tests: one captioned 5-frame clip (a square
sliding right over a gradient) as a frame folder, and a still image elsewhere (its first frame, the
square black) to sample from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def sliding_frame(i: int, side: int, colour: int = 255) -> Image.Image:
    """Frame `i`: the square (a quarter of the side) moved right by an eighth of the side per frame."""
    y, x = np.mgrid[0:side, 0:side]
    frame = np.stack([x * 255 // side, y * 255 // side, np.full_like(x, 60)], axis=-1).astype(np.uint8)
    step, size = side // 8, side // 4
    frame[size:2 * size, i * step:i * step + size] = colour
    return Image.fromarray(frame)


def sliding_clip_concept(tmp_path_factory, name: str, side: int) -> tuple[Path, Path]:
    """(the concept folder holding the clip, the still image)."""
    folder = tmp_path_factory.mktemp(f"{name}-clips")
    (folder / "slide").mkdir()
    for i in range(5):
        sliding_frame(i, side).save(folder / "slide" / f"{i:04d}.png")
    (folder / "slide.txt").write_text("a square sliding right")
    still = tmp_path_factory.mktemp(f"{name}-still") / "start.png"
    sliding_frame(0, side, colour=0).save(still)
    return folder, still
