"""What a latent or text cache entry must hold, by name, dtype and shape, to be used as it is.

An entry's key hashes its input (image and bucket, or caption) and the encoder, so a good entry
always has this layout; one that does not (a file damaged, hand-made, or written by a bug) would be accepted by
its names alone and fail where a batch stacks it (`stack expects each tensor to be equal size`).
It is treated as stale and encoded again.

The latent grid of a bucket is learned from the family itself, by encoding one small blank image
(the channels, and the downscale from its size): no family has to declare its VAE's geometry, and
a patchifying one (FLUX.2: 128 channels at 1/16) is measured like the others. A text entry's
layout is that of one caption encoded now (every family pads its tokens to a fixed length, so all
captions give the same shapes; the batches stack them), cut to the entry's real tokens for a family
whose cache stores only those (text_padding.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from modules.data.dataset import Entry
    from modules.model.base import ModelFamily

Layout = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (safetensors dtype, shape)
STORED_DTYPE = "F32"  # cache_build stores every tensor as float32


@dataclass(frozen=True)
class LatentGrid:
    channels: int
    downscale: int  # pixels per latent cell along each side

    def shape(self, width: int, height: int) -> tuple[int, int, int]:
        return self.channels, height // self.downscale, width // self.downscale


@torch.no_grad()
def measure_grid(family: ModelFamily, device: torch.device) -> LatentGrid:
    """Encode one blank image of the family's bucket quantum (the smallest bucket side)."""
    side = family.bucket_quantum
    latent = family.encode_images(torch.zeros(1, 3, side, side, device=device))
    return LatentGrid(latent.shape[1], side // latent.shape[-1])


def expected_latent_layout(entry: Entry, grid: LatentGrid) -> Layout:
    """The tensors cache_build writes for `entry` (its latents; mirrored and masks where it uses them)."""
    channels, height, width = grid.shape(*entry.bucket)
    frames = (entry.clip.latent_frames,) if entry.clip is not None and entry.clip.frames > 1 else ()
    layout = {"latents": (STORED_DTYPE, (channels, *frames, height, width))}
    if entry.flip:
        layout["latents_flipped"] = layout["latents"]
    if entry.mask is not None:
        layout["mask"] = (STORED_DTYPE, (1, height, width))
        if entry.flip:
            layout["mask_flipped"] = layout["mask"]
    return layout


def fits(found: Layout, expected: Layout) -> bool:
    """Every expected tensor is there with its dtype and shape (more tensors do no harm)."""
    return all(found.get(name) == want for name, want in expected.items())


@torch.no_grad()
def measure_text_layout(family: ModelFamily, caption: str, controls: list | None = None) -> Layout:
    """The layout cache_build writes for a caption (with its control images, for a family whose text
    encoder sees them): each conditioning tensor's row, as float32."""
    tokens = family.tokenize([caption], controls=[controls]) if controls else family.tokenize([caption])
    encoded = family.encode_text(tokens)
    return {name: (STORED_DTYPE, tuple(tensor.shape[1:])) for name, tensor in encoded.items()}
