"""A tiny random Qwen-Image-architecture pipeline: a two-layer Qwen2.5-VL (language model and a
one-block vision tower, as the released text encoder ships both), QwenImageTransformer2DModel and
AutoencoderKLQwenImage, with a byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.tiny.char_tokenizers import write_char_bpe_tokenizer

# The words of QwenImagePipeline's template before the caption, one token each as Qwen2.5's real
# tokenizer splits them, so the template's first 34 tokens (which the pipeline drops) are exactly
# its system line and user header here too.
_TEMPLATE_WORDS = ["system", "user", "assistant", "Describe", " the", " image", " by", " detailing", " color", ",",
                   " shape", " size", " texture", " quantity", " text", " spatial", " relationships", " of",
                   " objects", " and", " background", ":"]
# the template's 34 dropped tokens and 32 caption tokens
_MAX_LENGTH = 66


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    write_char_bpe_tokenizer(folder, max_length=_MAX_LENGTH)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.add_tokens(_TEMPLATE_WORDS)
    tokenizer.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0) -> Path:
    """A random Qwen-Image-architecture pipeline in diffusers layout, built offline."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    out = Path(out)
    torch.manual_seed(seed)
    tokenizer = _tokenizer(out / "tokenizer")
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=None),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0], window_size=28, patch_size=14),
    ))
    transformer_config = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                              num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
    transformer_config.update(transformer or {})
    # two spatial downsamples (no temporal one): latents at a quarter of the image size
    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, False])
    # the released scheduler config (resources/model_configs/qwen_image/scheduler)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
        str(Path(__file__).resolve().parents[3] / "resources" / "model_configs" / "qwen_image" / "scheduler"))
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=QwenImageTransformer2DModel(**transformer_config))
    pipe.save_pretrained(str(out))
    return out
