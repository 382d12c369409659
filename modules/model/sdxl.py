"""Stable Diffusion XL: two CLIP text encoders (CLIP-L hidden states, OpenCLIP-G hidden states and
pooled projection), a UNet2DConditionModel conditioned on the pooled embedding and the size/crop
time ids, AutoencoderKL; DDPM noise with epsilon or v-prediction targets.

Much is shared with SD1.5 (the UNet layout, the VAE, the CLIP-L encoder), so this family
subclasses it and overrides what differs. diffusers and transformers are imported inside methods.

Key names other tools use:
- kohya (sd-scripts' SDXL networks): `lora_unet_<ldm module>` (`lora_unet_input_blocks_4_1_...`),
  `lora_te1_text_model_...` (CLIP-L), `lora_te2_text_model_...` (CLIP-G).
- ComfyUI ("comfy"): `diffusion_model.<ldm module>`; the text encoders keep the kohya names,
  which ComfyUI and Forge both match (Forge does not match ComfyUI's `text_encoders.clip_l.`
  paths, which are still read when loading).
- diffusers: `unet.<module>`, `text_encoder.text_model...`, `text_encoder_2.text_model...`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.base import PartSpec
from modules.model.sd15 import SD15Family, _text_encoder_key, _vae_key
from modules.model.tiny_tokenizer import write_char_clip_tokenizer
from modules.util.torch_utils import make_generator

_UNET_ATTN = r"^unet\..*\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$"
_UNET_FF = r"^unet\..*\.ff\.net\.(0\.proj|2)$"
_TE_ATTN = r"^text_encoder(_2)?\..*\.self_attn\.(q_proj|k_proj|v_proj|out_proj)$"
_TE_MLP = r"^text_encoder(_2)?\..*\.mlp\.(fc1|fc2)$"

# SDXL's extra UNet modules under their ldm names (the rest is shared with SD1.x: ldm_unet.py)
_ADD_EMBEDDING = {"add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}


def sdxl_ldm_unet_module_name(unet, module_name: str) -> str:
    """The original (sgm) name of a diffusers SDXL UNet module."""
    from modules.adapters.formats.ldm_unet import ldm_unet_module_name

    for diffusers_name, ldm in _ADD_EMBEDDING.items():
        if module_name == diffusers_name or module_name.startswith(diffusers_name + "."):
            return ldm + module_name[len(diffusers_name):]
    return ldm_unet_module_name(unet, module_name)


class SDXLFamily(SD15Family):
    name = "sdxl"
    label = "Stable Diffusion XL"
    pipeline_classes = ("StableDiffusionXLPipeline",)
    denoiser_config = {"_class_name": "UNet2DConditionModel", "addition_embed_type": "text_time"}
    # label_emb is the UNet's text_time embedding; embedders.1 the OpenCLIP-G text encoder
    single_file_signature = (r"^model\.diffusion_model\.label_emb\.|^conditioner\.embedders\.1\.model\.", None)
    part_specs = (
        PartSpec("text_encoder", "text_encoder", "lora_te1"),
        PartSpec("text_encoder_2", "text_encoder_2", "lora_te2"),
        PartSpec("unet", "unet", "lora_unet", default_train=True),
        PartSpec("vae", "vae", None),
    )
    bucket_quantum = 64
    kohya_base_version = "sdxl_base_v1-0"
    modelspec_architecture = "stable-diffusion-xl-v1-base/lora"
    # CLIP-L is read at hidden_states[-2]; CLIP-G's last block feeds its pooled projection
    penultimate_parts = ("text_encoder",)
    layer_presets = {
        "attn": ([_UNET_ATTN, _TE_ATTN], False),
        "attn-mlp": ([_UNET_ATTN, _UNET_FF, _TE_ATTN, _TE_MLP], False),
        "all-linear": ([r"^(unet|text_encoder|text_encoder_2)\."], False),
        "all": ([r"^(unet|text_encoder|text_encoder_2)\."], True),
    }
    denoiser_part = "unet"
    nominal_part_parameters = {"text_encoder": 123_060_480, "text_encoder_2": 694_659_840,
                               "unet": 2_567_463_684, "vae": 83_653_863}
    text_parts = ("text_encoder", "text_encoder_2")
    embedding_slots = {"text_encoder": ("tokenizer", "clip_l"), "text_encoder_2": ("tokenizer_2", "clip_g")}
    image_parts = ("vae",)

    def load(self) -> None:
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import (
            CLIPTextModel,
            CLIPTextModelWithProjection,
            CLIPTokenizer,
        )

        self.parts["text_encoder"] = self.load_part("text_encoder", CLIPTextModel, rename=_text_encoder_key,
                                                    ignore_unexpected=[r"^embeddings\.position_ids$"])
        self.parts["text_encoder_2"] = self.load_part(
            "text_encoder_2", CLIPTextModelWithProjection,
            ignore_unexpected=[r"^text_model\.embeddings\.position_ids$"])
        self.parts["unet"] = self.load_part("unet", UNet2DConditionModel)
        self.parts["vae"] = self.load_part("vae", AutoencoderKL, rename=_vae_key)
        self.tokenizer = CLIPTokenizer.from_pretrained(str(self.support_folder("tokenizer")), local_files_only=True)
        self.tokenizer_2 = CLIPTokenizer.from_pretrained(str(self.support_folder("tokenizer_2")),
                                                         local_files_only=True)
        self.load_noise_scheduler()

    def single_file_part(self, part: str):
        # the original SDXL layout (sgm: model.diffusion_model., first_stage_model., conditioner.embedders.N.)
        from diffusers.loaders import single_file_utils as convert

        from modules.loading.single_file import SingleFilePart

        return {
            "unet": SingleFilePart(("model.diffusion_model.",),
                                   lambda sd, model: convert.convert_ldm_unet_checkpoint(sd, dict(model.config))),
            "vae": SingleFilePart(("first_stage_model.",),
                                  lambda sd, model: convert.convert_ldm_vae_checkpoint(sd, dict(model.config))),
            "text_encoder": SingleFilePart(("conditioner.embedders.0.transformer.",),
                                           lambda sd, model: convert.convert_ldm_clip_checkpoint(sd)),
            "text_encoder_2": SingleFilePart(
                ("conditioner.embedders.1.model.",),
                lambda sd, model: convert.convert_open_clip_checkpoint(model, sd, prefix="conditioner.embedders.1.model.")),
        }.get(part)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.parts["vae"].config.block_out_channels) - 1)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "text_encoder_2":
            return list(self.parts[part].text_model.encoder.layers)
        return super().checkpoint_blocks(part)

    # --- data --------------------------------------------------------------------------------

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for key, tokenizer in (("input_ids", self.tokenizer), ("input_ids_2", self.tokenizer_2)):
            out[key] = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length,
                                 truncation=True, return_tensors="pt").input_ids
        return out

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # as StableDiffusionXLPipeline.encode_prompt: the penultimate hidden states of both encoders,
        # side by side, and the second encoder's pooled projection
        first, second = self.parts["text_encoder"], self.parts["text_encoder_2"]
        out_1 = first(tokens["input_ids"].to(first.device), output_hidden_states=True)
        out_2 = second(tokens["input_ids_2"].to(second.device), output_hidden_states=True)
        hidden = torch.cat([out_1.hidden_states[-2], out_2.hidden_states[-2].to(out_1.hidden_states[-2].dtype)],
                           dim=-1)
        return {"hidden_states": hidden, "pooled": out_2.text_embeds}

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

    # --- adapters ----------------------------------------------------------------------------

    def adapter_name(self, part: str, module_name: str) -> str:
        # sd-scripts names SDXL UNet modules by their original (sgm) paths: lora_unet_input_blocks_4_1_...
        if part == "unet":
            return "lora_unet_" + sdxl_ldm_unet_module_name(self.unet, module_name).replace(".", "_")
        return super().adapter_name(part, module_name)

    def canonical_module_name(self, part: str, module_name: str) -> str:
        if part == "text_encoder" and not module_name.startswith("text_model."):
            return "text_model." + module_name
        return module_name

    def comfy_module_name(self, part: str, module_name: str) -> str:
        if part == "unet":
            return "diffusion_model." + sdxl_ldm_unet_module_name(self.unet, module_name)
        return self.adapter_name(part, module_name)  # lora_te1_/lora_te2_: ComfyUI and Forge (sd15.py)

    # --- tiny model --------------------------------------------------------------------------

    @classmethod
    def make_tiny_model(cls, out: str | Path, unet: dict | None = None, text: dict | None = None,
                        vae: dict | None = None, seed: int = 0) -> Path:
        """A random SDXL-architecture pipeline in diffusers layout, built offline."""
        from diffusers import (
            AutoencoderKL,
            EulerDiscreteScheduler,
            StableDiffusionXLPipeline,
            UNet2DConditionModel,
        )
        from transformers import (
            CLIPTextConfig,
            CLIPTextModel,
            CLIPTextModelWithProjection,
            CLIPTokenizer,
        )

        out = Path(out)
        torch.manual_seed(seed)
        tokenizers, encoders = [], []
        for index, (folder, model_cls) in enumerate((("tokenizer", CLIPTextModel),
                                                      ("tokenizer_2", CLIPTextModelWithProjection))):
            vocab_size = write_char_clip_tokenizer(out / folder)
            tokenizer = CLIPTokenizer.from_pretrained(str(out / folder))
            text_config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               max_position_embeddings=77, projection_dim=32,
                               hidden_act="quick_gelu" if index == 0 else "gelu")
            text_config.update(text or {})
            encoders.append(model_cls(CLIPTextConfig(
                vocab_size=vocab_size, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, **text_config,
            )))
            tokenizers.append(tokenizer)
        cross = encoders[0].config.hidden_size + encoders[1].config.hidden_size
        unet_config = dict(
            sample_size=32, block_out_channels=(32, 64), layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=cross, attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2),
            use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=6 * 8 + encoders[1].config.projection_dim, norm_num_groups=32,
        )
        unet_config.update(unet or {})
        vae_config = dict(
            block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=32, sample_size=64,
            scaling_factor=0.13025,
        )
        vae_config.update(vae or {})
        scheduler = EulerDiscreteScheduler(
            num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
            steps_offset=1, prediction_type="epsilon", timestep_spacing="leading",
        )
        pipe = StableDiffusionXLPipeline(
            vae=AutoencoderKL(**vae_config), text_encoder=encoders[0], text_encoder_2=encoders[1],
            tokenizer=tokenizers[0], tokenizer_2=tokenizers[1], unet=UNet2DConditionModel(**unet_config),
            scheduler=scheduler, force_zeros_for_empty_prompt=True, add_watermarker=False,
        )
        pipe.save_pretrained(str(out))
        return out
