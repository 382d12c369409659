"""A tiny random Wan-2.2-TI2V-architecture pipeline: tiny/wan.py's UMT5 half and transformer widths
with 48 latent channels, and the Wan 2.2 VAE's kind of AutoencoderKLWan (residual blocks, frames
2x2-patchified into 12 channels, z_dim 48) with two spatial and two temporal downsamples (8x
spatial with the patches, 4x in time), per-channel latent statistics that are not 0 and 1 (so the
normalisation is seen), the released UniPC scheduler config (flow_shift 5) and WanPipeline's
`expand_timesteps`, as Wan-AI/Wan2.2-TI2V-5B-Diffusers ships them."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.tiny.wan import TRANSFORMER, tiny_umt5

_CONFIGS = Path(__file__).resolve().parents[3] / "resources" / "model_configs" / "wan22_ti2v"
LATENT_CHANNELS = 48


def make_tiny_model(out: str | Path, seed: int = 0) -> Path:
    """A random Wan-2.2-TI2V-architecture pipeline in diffusers layout, built offline."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    out = Path(out)
    torch.manual_seed(seed)
    tokenizer, text_encoder = tiny_umt5(out)
    statistics = torch.Generator().manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=16, decoder_base_dim=24, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 2], num_res_blocks=1,
        temperal_downsample=[True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_spatial=8, scale_factor_temporal=4,
        latents_mean=(torch.randn(LATENT_CHANNELS, generator=statistics) * 0.2).tolist(),
        latents_std=(0.5 + torch.rand(LATENT_CHANNELS, generator=statistics)).tolist())
    transformer = WanTransformer3DModel(**{**TRANSFORMER, "in_channels": LATENT_CHANNELS,
                                           "out_channels": LATENT_CHANNELS})
    scheduler = UniPCMultistepScheduler.from_pretrained(str(_CONFIGS / "scheduler"))
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer, expand_timesteps=True)
    pipe.save_pretrained(str(out))
    return out
