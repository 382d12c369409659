"""A tiny random FIBO Edit pipeline (BriaFiboEditPipeline): a BriaFiboTransformer2DModel with one
joint and two single blocks, a SmolLM3ForCausalLM with SmolLM3's vocabulary size (the pipeline encodes
an empty prompt as token 128000) and a byte-level tokenizer, the Wan 2.2 kind of AutoencoderKLWan
(16x spatial compression, the pipeline's fixed scale) with non-trivial latent statistics, and a
dynamically shifting flow scheduler."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.tiny.char_tokenizers import write_char_bpe_tokenizer

_TEXT_WIDTH = 16
LATENT_CHANNELS = 16


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0) -> Path:
    """A random FIBO-Edit-architecture pipeline in diffusers layout, built offline."""
    from diffusers import (
        AutoencoderKLWan,
        BriaFiboEditPipeline,
        BriaFiboTransformer2DModel,
        FlowMatchEulerDiscreteScheduler,
    )
    from transformers import AutoTokenizer, SmolLM3Config, SmolLM3ForCausalLM

    out = Path(out)
    torch.manual_seed(seed)
    write_char_bpe_tokenizer(out / "tokenizer", max_length=160)
    tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    text_encoder = SmolLM3ForCausalLM(SmolLM3Config(
        vocab_size=128256, hidden_size=_TEXT_WIDTH, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True))
    statistics = torch.Generator().manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=16, decoder_base_dim=24, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_spatial=16, scale_factor_temporal=4,
        latents_mean=(torch.randn(LATENT_CHANNELS, generator=statistics) * 0.2).tolist(),
        latents_std=(0.5 + torch.rand(LATENT_CHANNELS, generator=statistics)).tolist())
    transformer_config = dict(
        patch_size=1, in_channels=LATENT_CHANNELS, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=2 * _TEXT_WIDTH, text_encoder_dim=_TEXT_WIDTH,
        axes_dims_rope=[4, 6, 6])
    transformer_config.update(transformer or {})
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    pipe = BriaFiboEditPipeline(transformer=BriaFiboTransformer2DModel(**transformer_config), scheduler=scheduler,
                                vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)
    pipe.save_pretrained(str(out))
    return out
