"""A tiny random Krea-2-architecture pipeline: a three-layer Qwen3-VL (language model and a one-block
vision tower, as Krea2Pipeline's Qwen3VLModel holds both) tapped at hidden states 1 and 2,
Krea2Transformer2DModel and AutoencoderKLQwenImage, with the byte-level tokenizer whose template
split is Qwen's (the 34 tokens before the caption, the 5 of the assistant suffix)."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.tiny.qwen_image import _tokenizer

_CONFIGS = Path(__file__).resolve().parents[3] / "resources" / "model_configs" / "krea2"


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0,
                    is_distilled: bool = False) -> Path:
    """A random Krea-2-architecture pipeline in diffusers layout, built offline."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        Krea2Pipeline,
        Krea2Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLModel

    out = Path(out)
    torch.manual_seed(seed)
    tokenizer = _tokenizer(out / "tokenizer")
    text_encoder = Qwen3VLModel(Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=None),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, deepstack_visual_indexes=[0]),
    ))
    transformer_config = dict(in_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=64, timestep_embed_dim=32, text_hidden_dim=32,
                              num_text_layers=2, text_num_attention_heads=4, text_num_key_value_heads=4,
                              text_intermediate_size=64, axes_dims_rope=(4, 6, 6))
    transformer_config.update(transformer or {})
    # two spatial downsamples (no temporal one): latents at a quarter of the image size
    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, False])
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(_CONFIGS / "scheduler"))
    # the last layer's output is never tapped (as layer 36 of the released 36: hidden_states[35] is the last read)
    pipe = Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=Krea2Transformer2DModel(**transformer_config),
                         text_encoder_select_layers=(1, 2), is_distilled=is_distilled, patch_size=2)
    pipe.save_pretrained(str(out))
    return out
