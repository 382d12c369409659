"""DDPM training (SD1.x, SDXL): integer timesteps on the model's scheduler, noise added by its
alphas, an epsilon or v-prediction target, and the timesteps' SNR for min-SNR weighting.

A family mixes `DDPMTraining` in before ModelFamily and implements `denoise`."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from modules.model.noise import Prediction


class DDPMTraining(ABC):
    """predict() for a denoiser trained on a DDPMScheduler; needs load_noise_scheduler() in load()."""

    flow_matching = False

    def load_noise_scheduler(self) -> None:
        """The DDPM training scheduler, and the prediction type (the config's, or the scheduler's)."""
        from diffusers import DDPMScheduler

        self.noise_scheduler = DDPMScheduler.from_pretrained(str(self.support_folder("scheduler")),
                                                             local_files_only=True)
        configured = self.config.model.prediction_type
        self.prediction_type = (
            self.noise_scheduler.config.prediction_type if configured == "auto" else configured
        )

    def training_timesteps(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """Integer DDPM timesteps from the configured distribution (uniform by default)."""
        steps = self.noise_scheduler.config.num_train_timesteps
        return (self.training_times(batch, generator) * steps).long().clamp(0, steps - 1)

    def snr(self, timesteps: torch.Tensor) -> torch.Tensor:
        alphas = self.noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
        return alphas / (1 - alphas)

    @abstractmethod
    def denoise(self, noisy: torch.Tensor, timesteps: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The denoiser's output (epsilon or v) for noisy latents at integer `timesteps`."""

    def predict(self, latents, text, generator):
        batch = latents.shape[0]
        noise = self.training_noise(latents, generator)
        timesteps = self.training_timesteps(batch, generator).to(latents.device)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = self.denoise(noisy, timesteps, text)
        v_prediction = self.prediction_type == "v_prediction"
        target = self.noise_scheduler.get_velocity(latents, noise, timesteps) if v_prediction else noise
        return Prediction(prediction, target, self.snr(timesteps), v_prediction)
