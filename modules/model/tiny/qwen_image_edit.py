"""A tiny random Qwen-Image-Edit pipeline: Qwen-Image's tiny transformer and VAE (tiny/qwen_image.py),
a two-layer Qwen2.5-VL with a one-block vision tower (both halves used here), a byte-level tokenizer
with Qwen2.5-VL's vision tokens, and the processor's image half (Qwen2VLImageProcessorPil's own
defaults: 14 px patches, 2x2 merge) in processor/, as the released folders ship them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from modules.model.tiny.char_tokenizers import write_char_bpe_tokenizer

# caption tokens kept after the template's 64 dropped ones (the image tokens come on top)
_CAPTION_TOKENS = 32
_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


def _tokenizer(folder: Path):
    """Byte-level, with each word of the edit system prompt one token (as Qwen2.5's tokenizer splits it,
    so its first 64 tokens are the system line and user header here too) and the vision tokens."""
    from transformers import AutoTokenizer

    from modules.model.qwen_image_edit import EDIT_TOKENS_DROPPED, SYSTEM_PREFIX

    write_char_bpe_tokenizer(folder, max_length=EDIT_TOKENS_DROPPED + _CAPTION_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    plain = SYSTEM_PREFIX.replace("<|im_start|>", "").replace("<|im_end|>", "")
    tokenizer.add_tokens(sorted({w for w in re.findall(r" ?[A-Za-z']+", plain) if len(w) > 1}))
    tokenizer.add_special_tokens({"additional_special_tokens": _VISION_TOKENS})
    tokenizer.save_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    count = len(tokenizer(SYSTEM_PREFIX, add_special_tokens=False).input_ids)
    assert count == EDIT_TOKENS_DROPPED, count  # the builder's own invariant (the family checks it on load)
    return tokenizer


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0,
                    pipeline: str = "QwenImageEditPipeline") -> Path:
    """A random Qwen-Image-Edit-architecture pipeline in diffusers layout, built offline (`pipeline`:
    QwenImageEditPlusPipeline for Edit-Plus; transformer options such as 2511's zero_cond_t)."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out)
    torch.manual_seed(seed)
    tokenizer = _tokenizer(out / "tokenizer")
    ids = tokenizer.convert_tokens_to_ids(_VISION_TOKENS)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=None),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0], window_size=28, patch_size=14),
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
    ))
    transformer_config = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                              num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
    transformer_config.update(transformer or {})
    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, False])
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
        str(Path(__file__).resolve().parents[3] / "resources" / "model_configs" / "qwen_image" / "scheduler"))
    pipe = getattr(diffusers, pipeline)(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                        processor=None, transformer=QwenImageTransformer2DModel(**transformer_config))
    pipe.save_pretrained(str(out))
    # the released processor/ folder (Qwen2VLProcessor: the tokenizer and the image processor's config),
    # named in model_index as released; that class needs torchvision, so the family reads the two halves
    # (and a pipeline loads here with processor=None)
    Qwen2VLImageProcessorPil().save_pretrained(str(out / "processor"))
    tokenizer.save_pretrained(str(out / "processor"))
    index = json.loads((out / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
