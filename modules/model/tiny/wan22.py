"""A tiny random Wan-2.2-A14B-architecture pipeline: tiny/wan.py's UMT5 encoder, VAE and scheduler,
two tiny WanTransformer3DModels of one shape with different random weights (the high-noise
`transformer` and the low-noise `transformer_2`), and the released folder's boundary_ratio."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from modules.model.tiny.wan import tiny_wan_components

_CONFIGS = Path(__file__).resolve().parents[3] / "resources" / "model_configs" / "wan22"


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0) -> Path:
    """A random Wan-2.2-A14B-architecture pipeline in diffusers layout, built offline."""
    from diffusers import WanPipeline, WanTransformer3DModel

    out = Path(out)
    torch.manual_seed(seed)
    components, transformer_config = tiny_wan_components(out, transformer)
    boundary = json.loads((_CONFIGS / "model_index.json").read_text(encoding="utf-8"))["boundary_ratio"]
    pipe = WanPipeline(**components, transformer=WanTransformer3DModel(**transformer_config),
                       transformer_2=WanTransformer3DModel(**transformer_config), boundary_ratio=boundary)
    pipe.save_pretrained(str(out))
    return out
