"""Loss masks: `<image stem>-masklabel.png` beside an image (white: train here, black: weight
`unmasked_weight`), cropped like the image and brought down to the latent grid by area."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from modules.data.images import open_covering
from modules.data.mask_files import mask_path  # noqa: F401  (the data pipeline's name for it)


def load_mask(path: Path, width: int, height: int, position: tuple[float, float] = (0.5, 0.5)) -> torch.Tensor:
    """(1, height, width) in [0, 1], resized to cover and cropped at `position` as load_cropped does."""
    image = open_covering(path, "L", width, height, position, Image.Resampling.BILINEAR)
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)[None]


def latent_mask(mask: torch.Tensor, latent_height: int, latent_width: int) -> torch.Tensor:
    return F.adaptive_avg_pool2d(mask[None], (latent_height, latent_width))[0]


def loss_weights(masks: torch.Tensor, unmasked_weight: torch.Tensor) -> torch.Tensor:
    """Per-pixel weights: 1 where the mask is white, `unmasked_weight` (per sample) where black."""
    low = unmasked_weight.view(-1, 1, 1, 1).to(masks)
    return low + (1 - low) * masks
