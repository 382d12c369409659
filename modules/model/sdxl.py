"""Stable Diffusion XL: two CLIP text encoders (CLIP-L hidden states, OpenCLIP-G hidden states and
pooled projection), a UNet2DConditionModel conditioned on the pooled embedding and the size/crop
time ids, AutoencoderKL; DDPM noise with epsilon or v-prediction targets.

Much is shared with SD1.5 (the UNet layout, the VAE, the CLIP-L encoder, DDPM training), so this
family subclasses it and overrides what differs. diffusers and transformers are imported inside
methods. Adapter key names: modules/model/keys/sdxl.py.
"""

from __future__ import annotations

import torch

from modules.config.families.sdxl import DECLARATION
from modules.model.components.clip import (
    clip_encoder_layers,
    clip_input_ids,
    clip_window,
    ldm_clip_single_file,
    load_clip_text_encoder,
    load_clip_text_encoder_with_projection,
    load_clip_tokenizer,
)
from modules.model.components.unet import ldm_unet_single_file
from modules.model.components.vae import ldm_vae_single_file, load_vae
from modules.model.keys.sdxl import SDXL_KEYS
from modules.model.sd15 import SD15Family
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator


class SDXLFamily(SD15Family):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/
    pipeline_classes = ("StableDiffusionXLPipeline",)
    denoiser_config = {"_class_name": "UNet2DConditionModel", "addition_embed_type": "text_time"}
    # label_emb is the UNet's text_time embedding; embedders.1 the OpenCLIP-G text encoder
    single_file_signature = (r"^model\.diffusion_model\.label_emb\.|^conditioner\.embedders\.1\.model\.", None)
    kohya_base_version = "sdxl_base_v1-0"
    modelspec_architecture = "stable-diffusion-xl-v1-base/lora"
    key_layout = SDXL_KEYS
    # CLIP-L is read at hidden_states[-2]; CLIP-G's last block feeds its pooled projection
    penultimate_blocks = {"text_encoder": "encoder.layers"}
    nominal_part_parameters = {"text_encoder": 123_060_480, "text_encoder_2": 694_659_840,
                               "unet": 2_567_463_684, "vae": 83_653_863}
    text_parts = ("text_encoder", "text_encoder_2")
    embedding_slots = {"text_encoder": ("tokenizer", "clip_l"), "text_encoder_2": ("tokenizer_2", "clip_g")}
    image_parts = ("vae",)

    def load(self) -> None:
        from diffusers import UNet2DConditionModel

        self.parts["text_encoder"] = load_clip_text_encoder(self, "text_encoder")
        self.parts["text_encoder_2"] = load_clip_text_encoder_with_projection(self, "text_encoder_2")
        self.parts["unet"] = self.load_part("unet", UNet2DConditionModel)
        self.parts["vae"] = load_vae(self)
        self.load_noise_scheduler()
        self.tokenizer = load_clip_tokenizer(self)
        self.tokenizer_2 = load_clip_tokenizer(self, "tokenizer_2")

    def single_file_part(self, part: str):
        # the original SDXL layout (sgm: model.diffusion_model., first_stage_model., conditioner.embedders.N.)
        from diffusers.loaders import single_file_utils as convert

        from modules.loading.single_file import SingleFilePart

        return {
            "unet": ldm_unet_single_file(),
            "vae": ldm_vae_single_file("first_stage_model."),
            "text_encoder": ldm_clip_single_file("conditioner.embedders.0.transformer."),
            "text_encoder_2": SingleFilePart(
                ("conditioner.embedders.1.model.",),
                lambda sd, model: convert.convert_open_clip_checkpoint(model, sd, prefix="conditioner.embedders.1.model.")),
        }.get(part)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.parts["vae"].config.block_out_channels) - 1)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "text_encoder_2":
            return clip_encoder_layers(self.parts[part])
        return super().checkpoint_blocks(part)

    # --- data --------------------------------------------------------------------------------

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        return {"input_ids": clip_input_ids(self.tokenizer, captions),
                "input_ids_2": clip_input_ids(self.tokenizer_2, captions)}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # as StableDiffusionXLPipeline.encode_prompt: the penultimate hidden states of both encoders,
        # side by side, and the second encoder's pooled projection
        first, second = self.parts["text_encoder"], self.parts["text_encoder_2"]
        out_1 = first(tokens["input_ids"].to(compute_device(first)), output_hidden_states=True)
        out_2 = second(tokens["input_ids_2"].to(compute_device(second)), output_hidden_states=True)
        hidden = torch.cat([out_1.hidden_states[-2], out_2.hidden_states[-2].to(out_1.hidden_states[-2].dtype)],
                           dim=-1)
        return {"hidden_states": hidden, "pooled": out_2.text_embeds}

    def planning_tokens(self, batch, device):
        first, second = self.parts["text_encoder"], self.parts["text_encoder_2"]
        return {"input_ids": self.planning_ids(batch, clip_window(getattr(self, "tokenizer", None), first), device),
                "input_ids_2": self.planning_ids(batch, clip_window(getattr(self, "tokenizer_2", None), second),
                                                 device)}

    def planning_conditioning(self, batch, device):
        first, second = self.parts["text_encoder"], self.parts["text_encoder_2"]
        window = clip_window(getattr(self, "tokenizer", None), first)
        width = first.config.hidden_size + second.config.hidden_size
        return {"hidden_states": torch.empty(batch, window, width, dtype=self.compute_dtype("text_encoder"),
                                             device=device),
                "pooled": torch.empty(batch, second.config.projection_dim, dtype=self.compute_dtype("text_encoder_2"),
                                      device=device)}

    # --- training ----------------------------------------------------------------------------

    def time_ids(self, latents: torch.Tensor, image_info: torch.Tensor | None = None) -> torch.Tensor:
        """(original size, crop top-left, target size) per image, as SDXL was trained: the image
        file's size and where the bucket's crop was taken (`image_info` from the data pipeline);
        without it (sampling-like calls), the bucket's size and no crop."""
        height, width = (d * self.vae_scale_factor for d in latents.shape[-2:])
        target = torch.tensor([height, width], dtype=torch.float32, device=latents.device).expand(latents.shape[0], 2)
        if image_info is None:
            return torch.cat([target, torch.zeros_like(target), target], dim=1)
        return torch.cat([image_info.to(device=latents.device, dtype=torch.float32), target], dim=1)

    def unet_conditioning(self, latents, text, dtype):
        # SDXL also conditions on the pooled text embedding and the size/crop time ids
        return {**super().unet_conditioning(latents, text, dtype),
                "added_cond_kwargs": {"text_embeds": text["pooled"].to(dtype),
                                      "time_ids": self.time_ids(latents, text.get("image_info")).to(dtype)}}

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import StableDiffusionXLPipeline

        from modules.sampling.schedulers import sampling_scheduler

        scheduler_config = dict(self.noise_scheduler.config, prediction_type=self.prediction_type)
        pipe = StableDiffusionXLPipeline(
            vae=self.parts["vae"], text_encoder=self.parts["text_encoder"],
            text_encoder_2=self.parts["text_encoder_2"], tokenizer=self.tokenizer, tokenizer_2=self.tokenizer_2,
            unet=self.unet, scheduler=sampling_scheduler(self.config.sampling.scheduler, scheduler_config),
            force_zeros_for_empty_prompt=True, add_watermarker=False,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sampling_dtype(self, part: str) -> torch.dtype:
        # StableDiffusionXLPipeline decodes with a float16 VAE moved to float32 (and back) when the
        # VAE's config says force_upcast: SDXL's VAE overflows in float16
        dtype = super().sampling_dtype(part)
        if part == "vae" and dtype == torch.float16 and self.parts["vae"].config.force_upcast:
            return torch.float32
        return dtype

    def run_sampling_pipeline(self, prompt, device):
        generator = make_generator(device, prompt.seed)
        return self.pipeline()(
            prompt=prompt.prompt, negative_prompt=prompt.negative_prompt or None,
            num_inference_steps=prompt.steps, guidance_scale=prompt.cfg, width=prompt.width, height=prompt.height,
            generator=generator,
        ).images[0]
