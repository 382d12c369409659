"""A tiny random Anima-architecture modular pipeline (AnimaModularPipeline's folder: a
modular_model_index.json and one folder per component): a two-layer Qwen3 text encoder with a
byte-level tokenizer, a T5-style tokenizer for the LLM adapter's query tokens, AnimaTextConditioner,
CosmosTransformer3DModel and AutoencoderKLQwenImage."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.tiny.char_tokenizers import write_char_bpe_tokenizer, write_char_sentencepiece_tokenizer

# the captions' token window (both tokenizers) and the adapter's padded length
_MAX_LENGTH = 32


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0) -> Path:
    """A random Anima-architecture modular pipeline in diffusers layout, built offline."""
    from diffusers import (
        AnimaAutoBlocks,
        AnimaTextConditioner,
        AutoencoderKLQwenImage,
        CosmosTransformer3DModel,
        FlowMatchEulerDiscreteScheduler,
    )
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    out = Path(out)
    torch.manual_seed(seed)
    write_char_bpe_tokenizer(out / "tokenizer", max_length=_MAX_LENGTH)
    tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    t5_vocab = write_char_sentencepiece_tokenizer(out / "t5_tokenizer", max_length=_MAX_LENGTH)
    t5_tokenizer = AutoTokenizer.from_pretrained(str(out / "t5_tokenizer"))
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
    ))
    text_conditioner = AnimaTextConditioner(source_dim=32, target_dim=32, model_dim=32, num_layers=2,
                                            num_attention_heads=4, target_vocab_size=t5_vocab,
                                            min_sequence_length=_MAX_LENGTH)
    # Cosmos-Predict2's layout (no learnable position embedding, the padding-mask channel), tiny widths
    transformer_config = {"in_channels": 16, "out_channels": 16, "num_attention_heads": 2, "attention_head_dim": 16,
                          "num_layers": 2, "text_embed_dim": 32, "adaln_lora_dim": 8, "max_size": (4, 32, 32),
                          "patch_size": (1, 2, 2), "rope_scale": (1.0, 4.0, 4.0), "concat_padding_mask": True,
                          "extra_pos_embed_type": None}
    transformer_config.update(transformer or {})
    # two spatial downsamples (no temporal one): latents at a quarter of the image size
    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, False])
    # the released scheduler's fixed shift (ComfyUI's Anima sampling_settings: shift 3.0)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = AnimaAutoBlocks().init_pipeline()
    pipe.update_components(text_encoder=text_encoder, tokenizer=tokenizer, t5_tokenizer=t5_tokenizer,
                           text_conditioner=text_conditioner, transformer=CosmosTransformer3DModel(**transformer_config),
                           vae=vae, scheduler=scheduler)
    pipe.save_pretrained(str(out), overwrite_modular_index=True)
    return out
