"""A tiny random Chroma-architecture pipeline (one T5 encoder, the Chroma transformer with its
distilled guidance layer, the 16-channel FLUX.1 VAE)."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.tiny.char_tokenizers import write_char_sentencepiece_tokenizer
from modules.model.tiny.parts import tiny_flux_vae


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0) -> Path:
    """A random Chroma-architecture pipeline in diffusers layout, built offline."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    out = Path(out)
    torch.manual_seed(seed)
    vocab = write_char_sentencepiece_tokenizer(out / "tokenizer", max_length=32)
    tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    t5 = T5EncoderModel(T5Config(
        vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))
    transformer_config = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16,
                              num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
                              approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=2)
    transformer_config.update(transformer or {})
    # as resources/model_configs/chroma/scheduler: shifted by the image's sequence length (ChromaPipeline
    # always computes that shift, `mu`, from these fields)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = ChromaPipeline(scheduler=scheduler, vae=tiny_flux_vae(), text_encoder=t5, tokenizer=tokenizer,
                          transformer=ChromaTransformer2DModel(**transformer_config))
    pipe.save_pretrained(str(out))
    return out
