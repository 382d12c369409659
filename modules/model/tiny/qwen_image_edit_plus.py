"""A tiny random Qwen-Image-Edit-Plus pipeline: the tiny Qwen-Image-Edit (tiny/qwen_image_edit.py)
under QwenImageEditPlusPipeline; `variant` "2511" gives the transformer 2511's `zero_cond_t`."""

from __future__ import annotations

from pathlib import Path

from modules.model.tiny.qwen_image_edit import make_tiny_model as make_tiny_edit_model


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0, variant: str = "2509") -> Path:
    if variant not in ("2509", "2511"):
        raise ValueError(f"variant: '2509' or '2511', not {variant!r}")
    options = {**(transformer or {}), **({"zero_cond_t": True} if variant == "2511" else {})}
    return make_tiny_edit_model(out, options, seed, pipeline="QwenImageEditPlusPipeline")
