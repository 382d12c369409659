"""Stable Diffusion 1.x: CLIP-L text encoder, UNet2DConditionModel, AutoencoderKL, DDPM noise
with epsilon or v-prediction targets.

diffusers and transformers are imported inside the methods that use them: validating a config
reads this file's part list, and should not pay seconds of imports for it.
"""

from __future__ import annotations

import torch

from modules.config.families.sd15 import DECLARATION
from modules.model.base import ModelFamily
from modules.model.components.clip import (
    clip_encoder_layers,
    clip_input_ids,
    clip_window,
    ldm_clip_single_file,
    load_clip_text_encoder,
    load_clip_tokenizer,
)
from modules.model.components.ddpm import DDPMTraining
from modules.model.components.unet import ldm_unet_single_file, unet_checkpoint_blocks
from modules.model.components.vae import encode_latents, ldm_vae_single_file, load_vae
from modules.model.keys.sd15 import SD15_KEYS
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator


class SD15Family(DDPMTraining, ModelFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/
    # SD 2.x shares the architecture (and pipeline class); SDXL's UNet adds a text_time embedding
    pipeline_classes = ("StableDiffusionPipeline",)
    denoiser_config = {"_class_name": "UNet2DConditionModel", "addition_embed_type": None}
    single_file_signature = (r"^model\.diffusion_model\.input_blocks\.", r"^model\.diffusion_model\.label_emb\.")
    kohya_base_version = "sd_v1"
    batched_guidance_above = 1.0  # its pipeline's cfg batch: torch.cat([latents] * 2) above guidance 1
    modelspec_architecture = "stable-diffusion-v1/lora"
    key_layout = SD15_KEYS

    nominal_part_parameters = {"text_encoder": 123_060_480, "unet": 859_520_964, "vae": 83_653_863}

    text_parts = ("text_encoder",)
    embedding_slots = {"text_encoder": ("tokenizer", "emb_params")}  # A1111's SD1 embedding key
    image_parts = ("vae",)

    def load(self) -> None:
        from diffusers import UNet2DConditionModel

        self.parts["text_encoder"] = load_clip_text_encoder(self, "text_encoder")
        self.parts["unet"] = self.load_part("unet", UNet2DConditionModel)
        self.parts["vae"] = load_vae(self)
        self.load_noise_scheduler()
        self.tokenizer = load_clip_tokenizer(self)

    def single_file_part(self, part: str):
        # the original SD1.x checkpoint layout (A1111, ComfyUI, model sites), read with diffusers' converters
        return {
            "unet": ldm_unet_single_file(),
            "vae": ldm_vae_single_file("first_stage_model."),
            "text_encoder": ldm_clip_single_file("cond_stage_model.transformer."),
        }.get(part)

    @property
    def unet(self):
        return self.parts["unet"]

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        # the units diffusers and transformers checkpoint: each resnet and transformer block of the
        # UNet (in the order the UNet runs them), each CLIP encoder layer
        if part == "text_encoder":
            return clip_encoder_layers(self.parts[part])
        if part != "unet":
            return []
        return unet_checkpoint_blocks(self.unet)

    # --- data --------------------------------------------------------------------------------

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        return encode_latents(self.parts["vae"], pixels, self.compute_dtype("vae"))

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        return {"input_ids": clip_input_ids(self.tokenizer, captions)}

    def caption_windows(self) -> list[tuple[object, int]]:
        return [(self.tokenizer, self.tokenizer.model_max_length)]  # CLIP's 77 (SDXL inherits it: both its encoders cut alike)

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text_encoder = self.parts["text_encoder"]
        hidden = text_encoder(tokens["input_ids"].to(compute_device(text_encoder)))[0]
        return {"hidden_states": hidden}

    def planning_tokens(self, batch, device):
        window = clip_window(getattr(self, "tokenizer", None), self.parts["text_encoder"])
        return {"input_ids": self.planning_ids(batch, window, device)}

    def planning_conditioning(self, batch, device):
        encoder = self.parts["text_encoder"]
        window = clip_window(getattr(self, "tokenizer", None), encoder)
        return {"hidden_states": torch.empty(batch, window, encoder.config.hidden_size,
                                             dtype=self.compute_dtype("text_encoder"), device=device)}

    # --- training ----------------------------------------------------------------------------

    def unet_conditioning(self, latents: torch.Tensor, text: dict[str, torch.Tensor],
                          dtype: torch.dtype) -> dict:
        """The UNet's keyword inputs besides the noisy latents and timesteps."""
        return {"encoder_hidden_states": text["hidden_states"].to(dtype)}

    def denoise(self, noisy: torch.Tensor, timesteps: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        dtype = self.compute_dtype("unet")
        return self.unet(noisy.to(dtype), timesteps, **self.unet_conditioning(noisy, text, dtype)).sample

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import StableDiffusionPipeline

        from modules.sampling.schedulers import sampling_scheduler

        scheduler_config = dict(self.noise_scheduler.config, prediction_type=self.prediction_type)
        pipe = StableDiffusionPipeline(
            vae=self.parts["vae"], text_encoder=self.parts["text_encoder"], tokenizer=self.tokenizer,
            unet=self.unet, scheduler=sampling_scheduler(self.config.sampling.scheduler, scheduler_config),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def run_sampling_pipeline(self, prompt, device):
        generator = make_generator(device, prompt.seed)
        return self.pipeline()(
            prompt=prompt.prompt, negative_prompt=prompt.negative_prompt or None,
            num_inference_steps=prompt.steps, guidance_scale=prompt.cfg, width=prompt.width, height=prompt.height,
            generator=generator,
        ).images[0]
