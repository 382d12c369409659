"""Rectified-flow training (FLUX.1, Z-Image): noise levels (sigmas) drawn logit-normal by default
and shifted as the model's FlowMatchEulerDiscreteScheduler config shifts its sampling schedule,
noisy = (1 - sigma) * latents + sigma * noise, target = noise - latents.

A family mixes `FlowMatchingTraining` in before ModelFamily and implements `denoise`."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from modules.model.noise import Prediction


def flow_sigmas(config, unit: torch.Tensor, sequence_length: int, shift: float | None = None) -> torch.Tensor:
    """Training noise levels for rectified flow from `unit` draws in (0, 1) (logit-normal by
    default, see ModelFamily.training_times), shifted as the model's FlowMatchEulerDiscreteScheduler
    config shifts its sampling schedule (by the image's sequence length where it shifts dynamically,
    else by its fixed `shift`), or by `shift` when the config's loss.flow_shift sets one."""
    if shift is None and config.get("use_dynamic_shifting"):
        slope = (config["max_shift"] - config["base_shift"]) / (config["max_image_seq_len"] - config["base_image_seq_len"])
        mu = config["base_shift"] + slope * (sequence_length - config["base_image_seq_len"])
        return math.exp(mu) / (math.exp(mu) + (1 / unit - 1))
    shift = shift if shift is not None else config.get("shift", 1.0)
    return shift * unit / (1 + (shift - 1) * unit)


class FlowMatchingTraining(ABC):
    """predict() for a velocity-predicting denoiser; needs load_flow_scheduler() in load()."""

    flow_matching = True  # rectified-flow target (no SNR weighting; logit-normal times)

    def load_flow_scheduler(self) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        self.noise_scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
            str(self.support_folder("scheduler")), local_files_only=True)

    def sequence_length(self, latents: torch.Tensor) -> int:
        """The image's token count, which a dynamically shifting schedule shifts by: 2x2 patches."""
        return (latents.shape[-2] // 2) * (latents.shape[-1] // 2)

    def sample_sigmas(self, batch: int, sequence_length: int, generator: torch.Generator) -> torch.Tensor:
        return flow_sigmas(self.noise_scheduler.config, self.training_times(batch, generator), sequence_length,
                           self.config.loss.flow_shift)

    @abstractmethod
    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow velocity (noise - clean) the denoiser predicts for (B, C, H, W) latents at `sigmas`."""

    def predict(self, latents, text, generator):
        noise = self.training_noise(latents, generator)
        sigmas = self.sample_sigmas(latents.shape[0], self.sequence_length(latents), generator).to(latents.device)
        expanded = sigmas.view(-1, *[1] * (latents.dim() - 1)).to(latents.dtype)  # images or (B, C, F, H, W) clips
        noisy = (1 - expanded) * latents + expanded * noise
        return Prediction(self.denoise(noisy, sigmas, text), noise - latents)
