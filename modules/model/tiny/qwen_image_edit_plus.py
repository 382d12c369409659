"""A tiny random Qwen-Image-Edit-Plus pipeline: the tiny Qwen-Image-Edit (tiny/qwen_image_edit.py)
under QwenImageEditPlusPipeline; `zero_cond_t=True` builds a 2511-style transformer."""

from __future__ import annotations

from pathlib import Path

from modules.model.tiny.qwen_image_edit import make_tiny_model as make_tiny_edit_model


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0, zero_cond_t: bool = False) -> Path:
    options = {**(transformer or {}), **({"zero_cond_t": True} if zero_cond_t else {})}
    return make_tiny_edit_model(out, options, seed, pipeline="QwenImageEditPlusPipeline")
