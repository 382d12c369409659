"""A tiny random FLUX.1-dev-architecture pipeline."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.tiny.char_tokenizers import write_char_sentencepiece_tokenizer
from modules.model.tiny.parts import tiny_clip, tiny_flux_vae


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0,
                    pipeline: str = "FluxPipeline") -> Path:
    """A random FLUX.1-dev-architecture pipeline in diffusers layout, built offline; `pipeline`:
    the diffusers class it is saved as (FluxKontextPipeline for Kontext, same components)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    out = Path(out)
    torch.manual_seed(seed)
    tokenizer, clip = tiny_clip(out / "tokenizer")
    t5_vocab = write_char_sentencepiece_tokenizer(out / "tokenizer_2", max_length=32)
    tokenizer_2 = AutoTokenizer.from_pretrained(str(out / "tokenizer_2"))
    t5 = T5EncoderModel(T5Config(
        vocab_size=t5_vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0,
    ))
    transformer_config = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                              pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    transformer_config.update(transformer or {})
    vae = tiny_flux_vae()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = getattr(diffusers, pipeline)(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=tokenizer,
                        text_encoder_2=t5, tokenizer_2=tokenizer_2,
                        transformer=FluxTransformer2DModel(**transformer_config))
    pipe.save_pretrained(str(out))
    return out
