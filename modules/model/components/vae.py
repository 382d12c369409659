"""The AutoencoderKL image part: loading (with the VAE attention names diffusers used before
0.14, still in many SD1.5 folders), images to scaled latents, and the original (ldm) single-file
layout. diffusers is imported inside the functions."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from modules.model.base import ModelFamily

# VAE attention weights under the names diffusers used before 0.14 (still in many SD1.5 folders)
_LEGACY_VAE_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def vae_key(key: str) -> str:
    module, _, tensor = key.rpartition(".")
    head, _, last = module.rpartition(".")
    if ".attentions." in module and last in _LEGACY_VAE_ATTENTION:
        return f"{head}.{_LEGACY_VAE_ATTENTION[last]}.{tensor}"
    return key


def load_vae(family: ModelFamily, part: str = "vae") -> torch.nn.Module:
    from diffusers import AutoencoderKL

    return family.load_part(part, AutoencoderKL, rename=vae_key)


def encode_latents(vae: torch.nn.Module, pixels: torch.Tensor, dtype: torch.dtype, shifted: bool = False) -> torch.Tensor:
    """pixels in [-1, 1] -> the scaled latents a denoiser trains on. The distribution's mean, so a
    cached latent is the same every time it is rebuilt; `shifted`: minus the config's shift_factor
    first (the FLUX.1 VAE, which Z-Image shares)."""
    latents = vae.encode(pixels.to(dtype)).latent_dist.mean
    if shifted:
        latents = latents - vae.config.shift_factor
    return latents * vae.config.scaling_factor


def ldm_vae_single_file(prefix: str):
    """An AutoencoderKL stored under `prefix` in an original-layout checkpoint."""
    from diffusers.loaders import single_file_utils as convert

    from modules.loading.single_file import SingleFilePart

    return SingleFilePart((prefix,), lambda sd, model: convert.convert_ldm_vae_checkpoint(sd, dict(model.config)))
