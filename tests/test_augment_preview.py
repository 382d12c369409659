"""The concept window's augmentation preview draws an edit pair's controls as training does (issue
29: "augmentations applied consistently to target and controls (a flip flips both)"): the same crop
position, the same mirror and the same colour draws as their target (modules/data/pairs.fresh_controls).
Pure functions of ui/augment_preview.py, no window."""

from __future__ import annotations

import numpy as np
from PIL import Image

from ui.augment_preview import augmented_draws


def _lopsided(path, size=(96, 64)):
    """Red on the left, blue on the right, with a gradient so that every crop position differs."""
    width, height = size
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:, : width // 2, 0] = 220
    pixels[:, width // 2:, 2] = 220
    pixels[..., 1] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    Image.fromarray(pixels).save(path)
    return path


DATA = {"resolution": 64, "aspect_buckets": True, "crop_jitter": True, "flip": True, "color_jitter": 0.3}


def test_a_control_is_drawn_beside_its_target_with_the_same_crop_mirror_and_colour(tmp_path):
    target = _lopsided(tmp_path / "target.png")
    control = _lopsided(tmp_path / "control.png")  # the same picture: every draw's halves must be equal
    plain = augmented_draws(target, DATA, "sd15", seed=3)
    paired = augmented_draws(target, DATA, "sd15", seed=3, controls=(control,))
    for alone, pair in zip(plain, paired):
        alone, pair = np.asarray(alone), np.asarray(pair)
        width = alone.shape[1]
        assert pair.shape == (alone.shape[0], 2 * width, 3)
        assert np.array_equal(pair[:, :width], alone)  # the target is drawn as without controls
        assert np.array_equal(pair[:, width:], pair[:, :width])  # and its control exactly as it
    mirrored = np.asarray(paired[1])
    assert mirrored[:, :8, 2].mean() > mirrored[:, :8, 0].mean()  # tile 2 is mirrored: blue on the left
    assert mirrored[:, -8:, 0].mean() > mirrored[:, -8:, 2].mean()  # its control too: red on its right


def test_several_controls_are_drawn_in_order(tmp_path):
    target = _lopsided(tmp_path / "target.png")
    red = tmp_path / "red.png"
    Image.new("RGB", (96, 64), (200, 0, 0)).save(red)
    green = tmp_path / "green.png"
    Image.new("RGB", (96, 64), (0, 200, 0)).save(green)
    draw = np.asarray(augmented_draws(target, {"resolution": 64}, "sd15", seed=0, count=1,
                                      controls=(red, green))[0]).astype(int)
    width = draw.shape[1] // 3
    assert draw[:, width:2 * width, 0].mean() > 150 and draw[:, 2 * width:, 1].mean() > 150
