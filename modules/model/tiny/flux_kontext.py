"""A tiny random FLUX.1 Kontext pipeline: FLUX.1's tiny components saved as FluxKontextPipeline."""

from __future__ import annotations

from pathlib import Path

from modules.model.tiny.flux import make_tiny_model as make_tiny_flux


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0) -> Path:
    return make_tiny_flux(out, transformer, seed, pipeline="FluxKontextPipeline")
