"""diffusers' CosmosTransformer3DModel (Cosmos-Predict2, Anima) resizes its padding mask with
torchvision (`transforms.functional.resize`, nearest) before concatenating it to the latents, and
imports torchvision only where it is installed; this project does not install it
(requirements.txt). Without it the transformer's forward stops on the missing name, so this gives
that module the one call it makes: a nearest-neighbour resize of the (B, 1, H, W) mask, which is
what torchvision's tensor resize does for NEAREST (torch.nn.functional.interpolate, "nearest").
With torchvision installed nothing is changed. Every caller (training, the family's pipeline and
a pipeline loaded from disk) runs the same code, so their outputs stay equal either way; the
pipelines pass an all-zero mask, whose resize is zero in any interpolation."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def _nearest_resize(mask: torch.Tensor, size: list[int], interpolation=None) -> torch.Tensor:
    return torch.nn.functional.interpolate(mask, size=list(size), mode="nearest")


def ensure_padding_mask_resize() -> None:
    """Give diffusers' Cosmos transformer module its mask resize where torchvision is absent."""
    from diffusers.models.transformers import transformer_cosmos

    if hasattr(transformer_cosmos, "transforms"):  # torchvision is installed, or already given
        return
    transformer_cosmos.transforms = SimpleNamespace(
        functional=SimpleNamespace(resize=_nearest_resize), InterpolationMode=SimpleNamespace(NEAREST="nearest"))
