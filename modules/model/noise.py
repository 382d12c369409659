"""What every family's training step draws: noise (with offset) and timesteps (by distribution),
and what it returns (`Prediction`). Families call these so the `loss` options mean the same
everywhere; the draws happen where the generator lives and then move."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Prediction(NamedTuple):
    prediction: torch.Tensor
    target: torch.Tensor
    # per-sample signal-to-noise ratio of the drawn timesteps, for min-SNR / debiased weighting;
    # None for flow-matching families, where those weightings do not apply
    snr: torch.Tensor | None = None
    v_prediction: bool = False


def draw_noise(latents: torch.Tensor, generator: torch.Generator, offset: float = 0.0,
               share: tuple[int, int] | None = None) -> torch.Tensor:
    """Gaussian noise shaped like `latents`; with `offset`, plus a per-sample, per-channel constant
    (noise offset: lets the model learn overall brightness it otherwise cannot). With `share`
    (first, total): drawn for a global batch of `total` and sliced from `first` (data parallel)."""
    first, total = share or (0, latents.shape[0])
    shape = (total, *latents.shape[1:])
    noise = torch.randn(shape, generator=generator, device=generator.device, dtype=latents.dtype)
    if offset:
        shift = torch.randn((*shape[:2], *([1] * (latents.dim() - 2))), generator=generator,
                            device=generator.device, dtype=latents.dtype)
        noise = noise + offset * shift
    return noise[first:first + latents.shape[0]].to(latents.device)


def draw_unit_times(batch: int, generator: torch.Generator, distribution: str, mean: float = 0.0,
                    std: float = 1.0, share: tuple[int, int] | None = None) -> torch.Tensor:
    """`batch` values in (0, 1): uniform, or logit-normal (sigmoid of N(mean, std): more weight
    on the middle of the schedule, as SD3 and Flux train). `share` as for draw_noise."""
    first, total = share or (0, batch)
    if distribution == "uniform":
        return torch.rand(total, generator=generator, device=generator.device)[first:first + batch]
    if distribution == "logit_normal":
        times = torch.sigmoid(torch.randn(total, generator=generator, device=generator.device) * std + mean)
        return times[first:first + batch]
    raise ValueError(f"loss.timesteps: unknown distribution {distribution!r}")
