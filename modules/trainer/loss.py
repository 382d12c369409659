"""The training loss from a family's Prediction and the config's `loss` options.

Per-sample losses (MSE, Huber or L1, averaged over everything but the batch) are weighted by the
timesteps' SNR where asked: min-SNR-gamma (Hang et al. 2023: min(SNR, gamma) / SNR, or
/ (SNR + 1) for v-prediction) and debiased estimation (1 / sqrt(SNR), with SNR capped at 1000 as
kohya does so the last steps do not blow up). Both need a family with an SNR (epsilon or
v-prediction); a flow-matching family has none, and the config is refused up front.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from modules.config.train_config import LossConfig
from modules.model.noise import Prediction

SNR_CAP = 1000.0


def snr_weighting_requested(config: LossConfig) -> str | None:
    """The dotted path of an option that needs SNR weighting, or None."""
    if config.min_snr_gamma is not None:
        return "loss.min_snr_gamma"
    if config.debiased_estimation:
        return "loss.debiased_estimation"
    return None


def training_loss(out: Prediction, config: LossConfig, sample_weights: torch.Tensor | None = None,
                  pixel_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The batch's loss; `sample_weights` (each sample's concept loss_weight) scale per sample,
    `pixel_weights` (B, 1, h, w; loss masks) per latent pixel, normalised by their mean so a
    masked sample weighs as much as an unmasked one."""
    prediction, target = out.prediction.float(), out.target.float()
    if config.type == "huber":
        elementwise = F.huber_loss(prediction, target, reduction="none", delta=config.huber_delta)
    elif config.type == "l1":
        elementwise = F.l1_loss(prediction, target, reduction="none")
    else:
        elementwise = F.mse_loss(prediction, target, reduction="none")
    dims = tuple(range(1, elementwise.dim()))
    if pixel_weights is not None:
        weights = pixel_weights.to(elementwise).expand_as(elementwise)
        per_sample = (elementwise * weights).sum(dim=dims) / weights.sum(dim=dims).clamp(min=1e-8)
    else:
        per_sample = elementwise.mean(dim=dims)
    if sample_weights is not None:
        per_sample = per_sample * sample_weights.to(per_sample)
    if snr_weighting_requested(config) is None:
        return per_sample.mean()
    if out.snr is None:
        raise ValueError(f"{snr_weighting_requested(config)}: this family's predictions carry no SNR")
    snr = out.snr.float().to(per_sample.device)
    weights = torch.ones_like(snr)
    if config.min_snr_gamma is not None:
        weights = weights * snr.clamp(max=config.min_snr_gamma) / (snr + 1 if out.v_prediction else snr)
    if config.debiased_estimation:
        weights = weights / snr.clamp(max=SNR_CAP).sqrt()
    return (per_sample * weights).mean()
