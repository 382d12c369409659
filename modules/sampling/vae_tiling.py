"""`sampling.vae_tiling`: the sample's VAE decode in overlapping tiles (diffusers' own tiled decode),
switched on around one sample and off after it, so the cache build and training never see it. The
switch holds for the whole pipeline, so the VAE encodes a pipeline makes itself (an image-to-video
prompt's image, control images) tile too: diffusers' `use_tiling` covers encode and decode.

AutoencoderKL-like VAEs (SD1.5, SDXL, FLUX.1, SD3; AutoencoderKLFlux2) tile at their config's
`sample_size`, which is 1024 px for SDXL's and so never tiles a 1024 px sample: they get
KL_TILE_PIXELS tiles (the latent tile follows from the VAE's downscale). The video-style VAEs
(AutoencoderKLWan, AutoencoderKLQwenImage) keep their class's tiles (256 px, stride 192). A VAE
without diffusers' tiling (no `use_tiling`) decodes whole: `supports_tiling` says which.

The plan's sampling phase (modules/plan/phase_pass.py) decodes inside the same context, so what it
plans is the path the run takes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from torch import nn

KL_TILE_PIXELS = 512  # SDXL's VAE at 1024 px decodes in 4 tiles of 64 latents (with 25% overlap, 3x3 calls)


def supports_tiling(vae: nn.Module) -> bool:
    """The VAE has diffusers' tiled decode (an `enable_tiling` that sets `use_tiling`)."""
    return hasattr(vae, "use_tiling") and callable(getattr(vae, "enable_tiling", None))


def _kl_like(vae: nn.Module) -> bool:
    return hasattr(vae, "tile_sample_min_size") and hasattr(vae, "tile_latent_min_size")


_TILE_ATTRIBUTES = ("use_tiling", "tile_sample_min_size", "tile_latent_min_size")


@contextlib.contextmanager
def tiled_decoding(vaes: Iterable[nn.Module], on: bool):
    """Inside the block each VAE of `vaes` that supports it decodes tiled when `on`; after it, each is
    as it was (its tiling flag and tile sizes)."""
    saved = []
    if on:
        for vae in vaes:
            if not supports_tiling(vae):
                continue
            saved.append((vae, {name: getattr(vae, name) for name in _TILE_ATTRIBUTES if hasattr(vae, name)}))
            vae.enable_tiling()
            if _kl_like(vae):
                downscale = vae.tile_sample_min_size / max(vae.tile_latent_min_size, 1)
                vae.tile_sample_min_size = KL_TILE_PIXELS
                vae.tile_latent_min_size = int(KL_TILE_PIXELS / downscale)
    try:
        yield
    finally:
        for vae, attributes in saved:
            for name, value in attributes.items():
                setattr(vae, name, value)


def tiling_vaes(parts: dict[str, nn.Module], image_parts: Iterable[str]) -> list[nn.Module]:
    """The image parts that decode latents (have `decode`) and can tile."""
    return [parts[name] for name in image_parts if name in parts and callable(getattr(parts[name], "decode", None))
            and supports_tiling(parts[name])]
