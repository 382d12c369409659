"""A tiny random SDXL-architecture pipeline."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.tiny.parts import tiny_clip, tiny_sd_vae


def make_tiny_model(out: str | Path, unet: dict | None = None, text: dict | None = None,
                    vae: dict | None = None, seed: int = 0) -> Path:
    """A random SDXL-architecture pipeline in diffusers layout, built offline."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    out = Path(out)
    torch.manual_seed(seed)
    tokenizers, encoders = [], []
    for index, (folder, model_cls) in enumerate((("tokenizer", CLIPTextModel),
                                                  ("tokenizer_2", CLIPTextModelWithProjection))):
        text_config = dict(hidden_act="quick_gelu" if index == 0 else "gelu")
        text_config.update(text or {})
        tokenizer, encoder = tiny_clip(out / folder, model_cls, **text_config)
        tokenizers.append(tokenizer)
        encoders.append(encoder)
    cross = encoders[0].config.hidden_size + encoders[1].config.hidden_size
    unet_config = dict(
        sample_size=32, block_out_channels=(32, 64), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=cross, attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2),
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + encoders[1].config.projection_dim, norm_num_groups=32,
    )
    unet_config.update(unet or {})
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        steps_offset=1, prediction_type="epsilon", timestep_spacing="leading",
    )
    pipe = StableDiffusionXLPipeline(
        vae=tiny_sd_vae(**{"scaling_factor": 0.13025, **(vae or {})}), text_encoder=encoders[0], text_encoder_2=encoders[1],
        tokenizer=tokenizers[0], tokenizer_2=tokenizers[1], unet=UNet2DConditionModel(**unet_config),
        scheduler=scheduler, force_zeros_for_empty_prompt=True, add_watermarker=False,
    )
    pipe.save_pretrained(str(out))
    return out
