"""Every image mode Pillow reads trains as what it shows: 16-bit grey scaled (not clipped to white),
palette, CMYK, 1-bit and grey converted, transparency composited on white (docs/data.md)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from modules.data.images import load_cropped


def _pixels(path) -> np.ndarray:
    """The trained image back in 0..255, (height, width, 3)."""
    return ((load_cropped(path, 16, 16).permute(1, 2, 0).numpy() + 1.0) * 127.5).round()


def _gradient16() -> np.ndarray:
    return np.tile(np.linspace(0, 65535, 16).astype(np.uint16), (16, 1))


@pytest.mark.parametrize("mode", ["I;16", "I"])
def test_16_bit_grey_is_scaled_not_white(tmp_path, mode):
    # a 16-bit PNG opens as I;16; 32-bit integer TIFFs (and older Pillows' 16-bit PNGs) as I
    path = tmp_path / ("grey16.png" if mode == "I;16" else "grey32.tiff")
    image = Image.fromarray(_gradient16()) if mode == "I;16" else Image.fromarray(_gradient16().astype(np.int32), "I")
    image.save(path)
    with Image.open(path) as opened:
        assert opened.mode in ("I;16", "I")
    pixels = _pixels(path)
    expected = np.linspace(0, 255, 16)
    assert np.allclose(pixels[8, :, 0], expected, atol=3), pixels[8, :, 0]
    assert np.array_equal(pixels[..., 0], pixels[..., 2])  # grey stays grey


def test_rgba_transparency_is_composited_on_white(tmp_path):
    array = np.zeros((16, 16, 4), np.uint8)
    array[..., 0] = 200  # red everywhere, in the colour channels of transparent pixels too
    array[:, :8, 3] = 255  # left half opaque, right half transparent
    array[:, 8:, 3] = 0
    Image.fromarray(array, "RGBA").save(tmp_path / "a.png")
    pixels = _pixels(tmp_path / "a.png")
    assert np.allclose(pixels[:, 2], [200, 0, 0], atol=2)
    assert np.allclose(pixels[:, 13], [255, 255, 255], atol=2)


def test_half_transparent_grey_with_alpha_blends_with_white(tmp_path):
    array = np.stack([np.zeros((16, 16), np.uint8), np.full((16, 16), 128, np.uint8)], -1)
    Image.fromarray(array, "LA").save(tmp_path / "la.png")
    assert np.allclose(_pixels(tmp_path / "la.png"), 127, atol=2)  # black at alpha 128 over white


def test_palette_with_a_transparent_index_is_composited(tmp_path):
    image = Image.new("P", (16, 16), 1)
    image.putpalette([0, 255, 0] + [0, 0, 255] * 255)  # index 0 green, the rest blue
    image.paste(0, (0, 0, 8, 16))
    image.save(tmp_path / "p.png", transparency=0)
    pixels = _pixels(tmp_path / "p.png")
    assert np.allclose(pixels[:, 2], 255, atol=2)  # the transparent green is white
    assert np.allclose(pixels[:, 13], [0, 0, 255], atol=2)


@pytest.mark.parametrize("mode, colour, expected", [
    ("CMYK", (0, 255, 255, 0), (255, 0, 0)),
    ("L", 77, (77, 77, 77)),
    ("1", 1, (255, 255, 255)),
])
def test_other_modes_convert_to_their_colours(tmp_path, mode, colour, expected):
    path = tmp_path / ("x.jpg" if mode == "CMYK" else "x.png")
    Image.new(mode, (16, 16), colour).save(path, **({"quality": 100} if mode == "CMYK" else {}))
    assert np.allclose(_pixels(path), expected, atol=4)
