"""Stable Diffusion 1.x: CLIP-L text encoder, UNet2DConditionModel, AutoencoderKL, DDPM noise
with epsilon or v-prediction targets.

diffusers and transformers are imported inside the methods that use them: validating a config
reads this file's part list, and should not pay seconds of imports for it.
"""

from __future__ import annotations

import re

from pathlib import Path

import torch

from modules.model.base import ModelFamily, PartSpec
from modules.model.noise import Prediction
from modules.model.tiny_tokenizer import write_char_clip_tokenizer
from modules.util.torch_utils import make_generator

_UNET_ATTN = r"^unet\..*\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$"
_UNET_FF = r"^unet\..*\.ff\.net\.(0\.proj|2)$"
_TE_ATTN = r"^text_encoder\..*\.self_attn\.(q_proj|k_proj|v_proj|out_proj)$"
_TE_MLP = r"^text_encoder\..*\.mlp\.(fc1|fc2)$"

# VAE attention weights under the names diffusers used before 0.14 (still in many SD1.5 folders)
_LEGACY_VAE_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def _text_encoder_key(key: str) -> str:
    # transformers 5 dropped CLIPTextModel's `text_model.` level; older exports keep it
    return key.removeprefix("text_model.")


def _vae_key(key: str) -> str:
    module, _, tensor = key.rpartition(".")
    head, _, last = module.rpartition(".")
    if ".attentions." in module and last in _LEGACY_VAE_ATTENTION:
        return f"{head}.{_LEGACY_VAE_ATTENTION[last]}.{tensor}"
    return key


class SD15Family(ModelFamily):
    name = "sd15"
    label = "Stable Diffusion 1.5"
    # SD 2.x shares the architecture (and pipeline class); SDXL's UNet adds a text_time embedding
    pipeline_classes = ("StableDiffusionPipeline",)
    denoiser_config = {"_class_name": "UNet2DConditionModel", "addition_embed_type": None}
    single_file_signature = (r"^model\.diffusion_model\.input_blocks\.", r"^model\.diffusion_model\.label_emb\.")
    part_specs = (
        PartSpec("text_encoder", "text_encoder", "lora_te"),
        PartSpec("unet", "unet", "lora_unet", default_train=True),
        PartSpec("vae", "vae", None),
    )
    bucket_quantum = 64
    kohya_base_version = "sd_v1"
    modelspec_architecture = "stable-diffusion-v1/lora"
    layer_presets = {
        "attn": ([_UNET_ATTN, _TE_ATTN], False),
        "attn-mlp": ([_UNET_ATTN, _UNET_FF, _TE_ATTN, _TE_MLP], False),
        "all-linear": ([r"^(unet|text_encoder)\."], False),
        "all": ([r"^(unet|text_encoder)\."], True),
    }

    denoiser_part = "unet"
    nominal_part_parameters = {"text_encoder": 123_060_480, "unet": 859_520_964, "vae": 83_653_863}

    text_parts = ("text_encoder",)
    embedding_slots = {"text_encoder": ("tokenizer", "emb_params")}  # A1111's SD1 embedding key
    image_parts = ("vae",)

    def load(self) -> None:
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        self.parts["text_encoder"] = self.load_part("text_encoder", CLIPTextModel, rename=_text_encoder_key,
                                                    ignore_unexpected=[r"^embeddings\.position_ids$"])
        self.parts["unet"] = self.load_part("unet", UNet2DConditionModel)
        self.parts["vae"] = self.load_part("vae", AutoencoderKL, rename=_vae_key)
        self.tokenizer = CLIPTokenizer.from_pretrained(str(self.support_folder("tokenizer")), local_files_only=True)
        self.load_noise_scheduler()

    def load_noise_scheduler(self) -> None:
        """The DDPM training scheduler, and the prediction type (the config's, or the scheduler's)."""
        from diffusers import DDPMScheduler

        self.noise_scheduler = DDPMScheduler.from_pretrained(str(self.support_folder("scheduler")),
                                                             local_files_only=True)
        configured = self.config.model.prediction_type
        self.prediction_type = (
            self.noise_scheduler.config.prediction_type if configured == "auto" else configured
        )

    def single_file_part(self, part: str):
        # the original SD1.x checkpoint layout (A1111, ComfyUI, model sites), read with diffusers' converters
        from diffusers.loaders import single_file_utils as convert

        from modules.loading.single_file import SingleFilePart

        return {
            "unet": SingleFilePart(("model.diffusion_model.",),
                                   lambda sd, model: convert.convert_ldm_unet_checkpoint(sd, dict(model.config))),
            "vae": SingleFilePart(("first_stage_model.",),
                                  lambda sd, model: convert.convert_ldm_vae_checkpoint(sd, dict(model.config))),
            "text_encoder": SingleFilePart(("cond_stage_model.transformer.",),
                                           lambda sd, model: convert.convert_ldm_clip_checkpoint(sd)),
        }.get(part)

    @property
    def unet(self):
        return self.parts["unet"]

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        # the units diffusers and transformers checkpoint: each resnet and transformer block of the
        # UNet (in the order the UNet runs them), each CLIP encoder layer
        if part == "text_encoder":
            return list(self.parts[part].encoder.layers)
        if part != "unet":
            return []
        blocks = []
        for stage in [*self.unet.down_blocks, self.unet.mid_block, *self.unet.up_blocks]:
            resnets, attentions = list(stage.resnets), list(getattr(stage, "attentions", None) or [])
            if stage is self.unet.mid_block:  # resnet, then (attention, resnet) pairs
                blocks.append(resnets[0])
                for attention, resnet in zip(attentions, resnets[1:]):
                    blocks += [attention, resnet]
                continue
            for index, resnet in enumerate(resnets):
                blocks.append(resnet)
                if index < len(attentions):
                    blocks.append(attentions[index])
        return blocks

    # --- data --------------------------------------------------------------------------------

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        vae = self.parts["vae"]
        # The distribution's mean, so a cached latent is the same every time it is rebuilt.
        latents = vae.encode(pixels.to(self.compute_dtype("vae"))).latent_dist.mean
        return latents * vae.config.scaling_factor

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        ids = self.tokenizer(
            captions, padding="max_length", max_length=self.tokenizer.model_max_length, truncation=True,
            return_tensors="pt",
        ).input_ids
        return {"input_ids": ids}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text_encoder = self.parts["text_encoder"]
        hidden = text_encoder(tokens["input_ids"].to(text_encoder.device))[0]
        return {"hidden_states": hidden}

    # --- training ----------------------------------------------------------------------------

    def training_timesteps(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """Integer DDPM timesteps from the configured distribution (uniform by default)."""
        steps = self.noise_scheduler.config.num_train_timesteps
        return (self.training_times(batch, generator) * steps).long().clamp(0, steps - 1)

    def snr(self, timesteps: torch.Tensor) -> torch.Tensor:
        alphas = self.noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
        return alphas / (1 - alphas)

    def unet_conditioning(self, latents: torch.Tensor, text: dict[str, torch.Tensor],
                          dtype: torch.dtype) -> dict:
        """The UNet's keyword inputs besides the noisy latents and timesteps."""
        return {"encoder_hidden_states": text["hidden_states"].to(dtype)}

    def predict(self, latents, text, generator):
        batch = latents.shape[0]
        noise = self.training_noise(latents, generator)
        timesteps = self.training_timesteps(batch, generator).to(latents.device)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        dtype = self.compute_dtype("unet")
        prediction = self.unet(noisy.to(dtype), timesteps, **self.unet_conditioning(latents, text, dtype)).sample
        v_prediction = self.prediction_type == "v_prediction"
        target = self.noise_scheduler.get_velocity(latents, noise, timesteps) if v_prediction else noise
        return Prediction(prediction, target, self.snr(timesteps), v_prediction)

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

    # --- adapters ----------------------------------------------------------------------------

    def canonical_module_name(self, part: str, module_name: str) -> str:
        # transformers 5 dropped CLIPTextModel's `text_model.` level; kohya, ComfyUI and diffusers
        # files keep it (lora_te_text_model_encoder_layers_0_...).
        if part == "text_encoder" and not module_name.startswith("text_model."):
            return "text_model." + module_name
        return module_name

    def comfy_module_name(self, part: str, module_name: str) -> str:
        # ComfyUI keeps the original (ldm) UNet names. Text encoders keep the kohya names
        # (lora_te_...): ComfyUI maps them, and Forge, which does not match ComfyUI's own
        # `text_encoders.clip_l.` paths, skips a whole file past 12 unmatched keys
        from modules.adapters.formats.ldm_unet import ldm_unet_module_name

        if part == "unet":
            return "diffusion_model." + ldm_unet_module_name(self.unet, module_name)
        return self.adapter_name(part, module_name)

    def comfyui_skips_diffusers_key(self, part: str, module_name: str) -> str | None:
        # ComfyUI maps diffusers UNet attention projections only as `.processor.to_q` (old diffusers)
        if part == "unet" and re.search(r"\.to_(q|k|v|out\.0)$", module_name):
            return "it reads UNet attention projections only as `...processor.to_q`"
        return None

    def other_stems(self, part: str, module_name: str) -> tuple[str, ...]:
        if part == "unet":
            return ()
        clip = {"text_encoder": "clip_l", "text_encoder_2": "clip_g"}[part]  # SDXL's second: CLIP-G
        return (f"text_encoders.{clip}.transformer." + self.canonical_module_name(part, module_name),)

    # --- tiny model --------------------------------------------------------------------------

    @classmethod
    def make_tiny_model(cls, out: str | Path, unet: dict | None = None, text: dict | None = None,
                        vae: dict | None = None, seed: int = 0) -> Path:
        """A random SD1.5-architecture pipeline in diffusers layout, built offline."""
        from diffusers import (
            AutoencoderKL,
            DDPMScheduler,
            StableDiffusionPipeline,
            UNet2DConditionModel,
        )
        from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

        out = Path(out)
        torch.manual_seed(seed)
        tokenizer_dir = out / "tokenizer"
        vocab_size = write_char_clip_tokenizer(tokenizer_dir)
        tokenizer = CLIPTokenizer.from_pretrained(str(tokenizer_dir))
        text_config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=77, projection_dim=32)
        text_config.update(text or {})
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=vocab_size, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, **text_config,
        ))
        unet_config = dict(
            sample_size=32, block_out_channels=(32, 64), layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=text_config["hidden_size"], attention_head_dim=8, norm_num_groups=32,
        )
        unet_config.update(unet or {})
        vae_config = dict(
            block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=32, sample_size=64,
        )
        vae_config.update(vae or {})
        scheduler = DDPMScheduler(
            num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
            clip_sample=False, steps_offset=1, prediction_type="epsilon",
        )
        pipe = StableDiffusionPipeline(
            vae=AutoencoderKL(**vae_config), text_encoder=text_encoder, tokenizer=tokenizer,
            unet=UNet2DConditionModel(**unet_config), scheduler=scheduler, safety_checker=None,
            feature_extractor=None, requires_safety_checker=False,
        )
        pipe.save_pretrained(str(out))
        return out
