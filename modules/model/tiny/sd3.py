"""A tiny random SD3.5-architecture pipeline."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.tiny.char_tokenizers import write_char_sentencepiece_tokenizer
from modules.model.tiny.parts import tiny_clip


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0) -> Path:
    """A random SD3.5-architecture pipeline in diffusers layout, built offline: CLIP-L and CLIP-G
    with projections, a T5 encoder as wide as both CLIPs side by side (the pipeline pads their
    hidden states to its width), an MMDiT with one dual-attention block (SD3.5 Medium's `attn2`),
    RMS q/k norms and a context-pre-only last block, and a 16-channel VAE with shift and scale."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    out = Path(out)
    torch.manual_seed(seed)
    tokenizer, clip_l = tiny_clip(out / "tokenizer", CLIPTextModelWithProjection, hidden_act="quick_gelu")
    tokenizer_2, clip_g = tiny_clip(out / "tokenizer_2", CLIPTextModelWithProjection, hidden_act="gelu")
    t5_vocab = write_char_sentencepiece_tokenizer(out / "tokenizer_3", max_length=32)
    tokenizer_3 = AutoTokenizer.from_pretrained(str(out / "tokenizer_3"))
    clip_width = clip_l.config.hidden_size + clip_g.config.hidden_size
    t5 = T5EncoderModel(T5Config(
        vocab_size=t5_vocab, d_model=clip_width, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0,
    ))
    transformer_config = dict(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=clip_width, caption_projection_dim=32,
        pooled_projection_dim=clip_l.config.projection_dim + clip_g.config.projection_dim, pos_embed_max_size=32,
        dual_attention_layers=(0,), qk_norm="rms_norm",
    )
    transformer_config.update(transformer or {})
    vae = AutoencoderKL(
        block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=16, norm_num_groups=32, sample_size=64,
        scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**transformer_config), scheduler=scheduler, vae=vae,
        text_encoder=clip_l, tokenizer=tokenizer, text_encoder_2=clip_g, tokenizer_2=tokenizer_2,
        text_encoder_3=t5, tokenizer_3=tokenizer_3,
    )
    pipe.save_pretrained(str(out))
    return out
