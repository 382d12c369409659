"""Tiny random components several families' tiny models share: a CLIP text encoder with its
character tokenizer, the SD VAE and the FLUX.1 VAE. diffusers and transformers are imported
inside the functions."""

from __future__ import annotations

from pathlib import Path

from modules.model.tiny.clip_tokenizer import write_char_clip_tokenizer


def tiny_clip(tokenizer_folder: Path, model_cls=None, **overrides):
    """(tokenizer, a random CLIP text encoder) with a character tokenizer written to `tokenizer_folder`."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab_size = write_char_clip_tokenizer(tokenizer_folder)
    tokenizer = CLIPTokenizer.from_pretrained(str(tokenizer_folder))
    config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=77, projection_dim=32)
    config.update(overrides)
    encoder = (model_cls or CLIPTextModel)(CLIPTextConfig(
        vocab_size=vocab_size, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **config,
    ))
    return tokenizer, encoder


def tiny_sd_vae(**overrides):
    """A random 4-channel AutoencoderKL with 2 down blocks (latents at half the image size)."""
    from diffusers import AutoencoderKL

    config = dict(
        block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=32, sample_size=64,
    )
    config.update(overrides)
    return AutoencoderKL(**config)


def tiny_flux_vae():
    """A random FLUX.1-style AutoencoderKL: 16 channels, shift and scale, no quant convs."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=16, norm_num_groups=32, sample_size=64,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    )
