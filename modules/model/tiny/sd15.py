"""A tiny random SD1.5-architecture pipeline."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.tiny.parts import tiny_clip, tiny_sd_vae


def make_tiny_model(out: str | Path, unet: dict | None = None, text: dict | None = None,
                    vae: dict | None = None, seed: int = 0) -> Path:
    """A random SD1.5-architecture pipeline in diffusers layout, built offline."""
    from diffusers import DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    out = Path(out)
    torch.manual_seed(seed)
    tokenizer, text_encoder = tiny_clip(out / "tokenizer", **(text or {}))
    unet_config = dict(
        sample_size=32, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=text_encoder.config.hidden_size, attention_head_dim=8, norm_num_groups=32,
    )
    unet_config.update(unet or {})
    scheduler = DDPMScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        clip_sample=False, steps_offset=1, prediction_type="epsilon",
    )
    pipe = StableDiffusionPipeline(
        vae=tiny_sd_vae(**(vae or {})), text_encoder=text_encoder, tokenizer=tokenizer,
        unet=UNet2DConditionModel(**unet_config), scheduler=scheduler, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )
    pipe.save_pretrained(str(out))
    return out
