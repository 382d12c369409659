"""A tiny random Wan-2.2-I2V-A14B-architecture pipeline: tiny/wan.py's UMT5 encoder, VAE and
scheduler, two tiny 36-channel WanTransformer3DModels of one shape with different random weights
(the high-noise `transformer` and the low-noise `transformer_2`; no image cross-attention), no
image encoder, and the released folder's scheduler and boundary_ratio, saved as
WanImageToVideoPipeline."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from modules.model.tiny.wan import tiny_wan_components

_CONFIGS = Path(__file__).resolve().parents[3] / "resources" / "model_configs" / "wan22_i2v"


def make_tiny_model(out: str | Path, seed: int = 0) -> Path:
    """A random Wan-2.2-I2V-A14B-architecture pipeline in diffusers layout, built offline."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel

    out = Path(out)
    torch.manual_seed(seed)
    components, transformer_config = tiny_wan_components(out, {"in_channels": 36})
    components["scheduler"] = UniPCMultistepScheduler.from_pretrained(str(_CONFIGS / "scheduler"))  # (flow_shift 3)
    boundary = json.loads((_CONFIGS / "model_index.json").read_text(encoding="utf-8"))["boundary_ratio"]
    pipe = WanImageToVideoPipeline(**components, transformer=WanTransformer3DModel(**transformer_config),
                                   transformer_2=WanTransformer3DModel(**transformer_config), boundary_ratio=boundary)
    pipe.save_pretrained(str(out))
    return out
