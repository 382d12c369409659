"""A tiny random Wan-2.1-I2V-architecture pipeline: tiny/wan.py's UMT5, VAE and scheduler with an
I2V transformer (36 input channels: noisy latents, first-frame mask, condition latents; image
cross-attention), a two-layer CLIPVisionModel from its transformers config and a CLIPImageProcessor
at its size. The tokenizer pads to 512 tokens, the count the I2V transformer's attention assumes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from modules.model.tiny import wan
from modules.model.tiny.char_tokenizers import write_char_sentencepiece_tokenizer

CLIP_WIDTH = 32
CLIP_SIDE = 32  # the CLIP's picture side (8 x 8 patches: 17 tokens with its class token)


def make_tiny_model(out: str | Path, seed: int = 0) -> Path:
    """A random Wan-2.1-I2V-architecture pipeline in diffusers layout, built offline."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    out = Path(out)
    # the tiny Wan transformer is 2 heads x 16 wide: its image cross-attention reads 32-wide embeddings
    wan.make_tiny_model(out, transformer={"in_channels": 36, "image_dim": CLIP_WIDTH, "added_kv_proj_dim": 32},
                        seed=seed)
    write_char_sentencepiece_tokenizer(out / "tokenizer", max_length=512)  # (the same characters)
    torch.manual_seed(seed + 1)
    encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=CLIP_WIDTH, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=CLIP_SIDE, patch_size=8, projection_dim=CLIP_WIDTH,
    ))
    encoder.save_pretrained(str(out / "image_encoder"))
    # its weights under `vision_model.`, as the released folders (saved by transformers 4) hold them
    save_file({f"vision_model.{k}": v.contiguous() for k, v in encoder.state_dict().items()},
              str(out / "image_encoder" / "model.safetensors"), metadata={"format": "pt"})
    CLIPImageProcessorPil(size={"shortest_edge": CLIP_SIDE}, crop_size={"height": CLIP_SIDE, "width": CLIP_SIDE}
                       ).save_pretrained(str(out / "image_processor"))
    index_path = out / "model_index.json"
    index = json.loads(index_path.read_text(encoding="utf-8"))
    index.update({"_class_name": "WanImageToVideoPipeline", "image_encoder": ["transformers", "CLIPVisionModel"],
                  "image_processor": ["transformers", "CLIPImageProcessor"]})
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out
