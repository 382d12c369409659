"""A tiny random Wan-2.1-I2V-architecture pipeline: tiny/wan.py's UMT5, VAE and scheduler with an
I2V transformer (36 input channels: noisy latents, first-frame mask, condition latents; image
cross-attention; in the FLF2V variant a random position embedding over two frames' image tokens),
a two-layer CLIPVisionModel from its transformers config and a CLIPImageProcessor at its size. The tokenizer pads to 512 tokens, the count the I2V transformer's attention assumes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modules.model.tiny import wan
from modules.model.tiny.char_tokenizers import write_char_sentencepiece_tokenizer

CLIP_WIDTH = 32
CLIP_SIDE = 32  # the CLIP's picture side (8 x 8 patches: 17 tokens with its class token)
CLIP_TOKENS = (CLIP_SIDE // 8) ** 2 + 1
POSITIONS = "condition_embedder.image_embedder.pos_embed"  # FLF2V's (1, 2 x tokens, CLIP width)


def make_tiny_model(out: str | Path, seed: int = 0, variant: str = "i2v") -> Path:
    """A random Wan-2.1-I2V-architecture pipeline in diffusers layout, built offline; `variant` "flf2v":
    Wan 2.1 FLF2V's, the transformer's image embedder positioned over two frames' CLIP tokens
    (`pos_embed_seq_len`) and its scheduler's flow_shift 16."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    if variant not in ("i2v", "flf2v"):
        raise ValueError(f"variant: 'i2v' or 'flf2v', not {variant!r}")
    out = Path(out)
    # the tiny Wan transformer is 2 heads x 16 wide: its image cross-attention reads 32-wide embeddings
    transformer = {"in_channels": 36, "image_dim": CLIP_WIDTH, "added_kv_proj_dim": 32}
    if variant == "flf2v":
        transformer["pos_embed_seq_len"] = 2 * CLIP_TOKENS
    wan.make_tiny_model(out, transformer=transformer, seed=seed)
    if variant == "flf2v":  # the released FLF2V scheduler's shift (diffusers' convert_wan_to_diffusers.py)
        weights = out / "transformer" / "diffusion_pytorch_model.safetensors"
        state = load_file(str(weights))
        # random, not the zeros the class starts it at, so a load that drops it shows
        state[POSITIONS] = torch.randn(state[POSITIONS].shape, generator=torch.Generator().manual_seed(seed)) * 0.1
        save_file(state, str(weights), metadata={"format": "pt"})
        scheduler_path = out / "scheduler" / "scheduler_config.json"
        scheduler = json.loads(scheduler_path.read_text(encoding="utf-8"))
        scheduler_path.write_text(json.dumps({**scheduler, "flow_shift": 16.0}, indent=2) + "\n", encoding="utf-8")
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
