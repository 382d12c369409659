"""Stable Diffusion 3 / 3.5 (Medium, Large): three text encoders (CLIP-L and CLIP-G, each with its
projection: penultimate hidden states side by side and both pooled embeddings; T5-XXL's last hidden
states after them), SD3Transformer2DModel (MMDiT: joint blocks over 2x2 patches, SD3.5 Medium's
dual-attention blocks), a 16-channel VAE with shift and scale; rectified-flow training with the
scheduler's fixed shift (3.0), the transformer's timestep sigma * 1000, target noise - latents,
as StableDiffusion3Pipeline samples it.

Every CLIP block reaches the loss (the last one through the pooled projection), so no part is
read at a penultimate block only (`penultimate_blocks` stays empty).

Adapter key names (kohya: sd-scripts' MMDiT names with q/k/v fused; comfy: the kohya file;
diffusers: `transformer.<module>`) are declared, with their sources, in modules/model/keys/sd3.py.
"""

from __future__ import annotations

import json
import re

import torch

from modules.config.families.sd3 import DECLARATION
from modules.loading.diffusers_folder import ModelLoadError
from modules.model.base import ModelFamily
from modules.model.components.clip import (
    clip_encoder_layers,
    clip_input_ids,
    clip_window,
    load_clip_text_encoder_with_projection,
    load_clip_tokenizer,
)
from modules.model.components.flow_matching import FlowMatchingTraining
from modules.model.components.vae import encode_latents, load_vae
from modules.model.keys.sd3 import SD3_KEYS
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator


T5_MAX_LENGTH = 256  # StableDiffusion3Pipeline's default max_sequence_length


class SD3Family(FlowMatchingTraining, ModelFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/
    pipeline_classes = ("StableDiffusion3Pipeline",)
    denoiser_config = {"_class_name": "SD3Transformer2DModel"}
    single_file_signature = (r"^(model\.diffusion_model\.)?joint_blocks\.", None)
    kohya_base_version = "sd3"
    batched_guidance_above = 1.0  # its pipeline's cfg batch: torch.cat([latents] * 2) above guidance 1
    modelspec_architecture = "stable-diffusion-v3-5-large/lora"
    key_layout = SD3_KEYS
    # SD3.5 Large (8.1 B transformer; Medium's is 2.2 B)
    nominal_part_parameters = {"text_encoder": 123_650_304, "text_encoder_2": 694_659_840,
                               "text_encoder_3": 4_893_906_944, "transformer": 8_056_627_520, "vae": 83_819_683}
    text_parts = ("text_encoder", "text_encoder_2", "text_encoder_3")
    image_parts = ("vae",)
    # ComfyUI's SD3 tokenizers' embedding keys (its sd3_clip.py)
    embedding_slots = {"text_encoder": ("tokenizer", "clip_l"), "text_encoder_2": ("tokenizer_2", "clip_g"),
                       "text_encoder_3": ("tokenizer_3", "t5xxl")}

    def load(self) -> None:
        from diffusers import SD3Transformer2DModel
        from transformers import AutoTokenizer, T5EncoderModel

        self.parts["text_encoder"] = load_clip_text_encoder_with_projection(self, "text_encoder")
        self.parts["text_encoder_2"] = load_clip_text_encoder_with_projection(self, "text_encoder_2")
        self.parts["text_encoder_3"] = self.load_part("text_encoder_3", T5EncoderModel,
                                                      ignore_unexpected=[r"^decoder\.", r"^lm_head\."])
        self.parts["transformer"] = self.load_part("transformer", SD3Transformer2DModel)
        self.parts["vae"] = load_vae(self)
        self.load_flow_scheduler()
        self.tokenizer = load_clip_tokenizer(self)
        self.tokenizer_2 = load_clip_tokenizer(self, "tokenizer_2")
        self.tokenizer_3 = AutoTokenizer.from_pretrained(str(self.support_folder("tokenizer_3")),
                                                         local_files_only=True)

    def part_folder(self, part: str):
        # a single file's MMDiT is built from the shipped config of the variant it holds: SD3.5
        # Large (`transformer/`), SD3.5 Medium or SD3 Medium, told apart by the file's block
        # count, dual-attention (attn2) blocks and q/k norms (ln_q)
        folder = super().part_folder(part)
        if part != "transformer" or not self.from_single_file(part):
            return folder
        try:
            keys = self.single_file_stream(part).keys()
        except ModelLoadError:  # an unreadable file: the load itself says so, naming it
            return folder
        blocks = {int(m.group(1)) for k in keys if (m := re.search(r"joint_blocks\.(\d+)\.", k))}
        holds = (max(blocks, default=-1) + 1, any(".attn2." in k for k in keys), any(".ln_q." in k for k in keys))
        for candidate in sorted(folder.parent.glob("transformer*/config.json")):
            config = json.loads(candidate.read_text(encoding="utf-8"))
            if (config["num_layers"], bool(config.get("dual_attention_layers")), bool(config.get("qk_norm"))) == holds:
                return candidate.parent
        return folder

    def single_file_part(self, part: str):
        # Stability's files: the MMDiT under model.diffusion_model. (bare in some re-exports), the
        # VAE under first_stage_model.; SD3 Medium's "incl_clips" files also carry the text
        # encoders under text_encoders.clip_l/clip_g/t5xxl.transformer. (SD3.5 ships them apart:
        # model.parts.<part>.path)
        from diffusers.loaders import single_file_utils as convert

        from modules.loading.single_file import SingleFilePart
        from modules.model.components.clip import ldm_clip_single_file
        from modules.model.components.vae import ldm_vae_single_file

        return {
            "transformer": SingleFilePart(
                ("model.diffusion_model.", "joint_blocks.", "x_embedder.", "pos_embed", "t_embedder.", "y_embedder.",
                 "context_embedder.", "final_layer."),
                lambda sd, model: convert.convert_sd3_transformer_checkpoint_to_diffusers(sd)),
            "vae": ldm_vae_single_file("first_stage_model."),
            "text_encoder": ldm_clip_single_file("text_encoders.clip_l.transformer.",
                                                 remove_prefix="text_encoders.clip_l.transformer."),
            "text_encoder_2": ldm_clip_single_file("text_encoders.clip_g.transformer.",
                                                   remove_prefix="text_encoders.clip_g.transformer."),
            "text_encoder_3": SingleFilePart(("text_encoders.t5xxl.transformer.",),
                                             lambda sd, model: convert.convert_sd3_t5_checkpoint_to_diffusers(sd)),
        }.get(part)

    @property
    def transformer(self):
        return self.parts["transformer"]

    def caption_windows(self) -> list[tuple[object, int]]:
        return [(self.tokenizer_3, self.max_sequence_length)]  # past CLIP's 77, T5 still reads

    @property
    def max_sequence_length(self) -> int:
        return min(self.tokenizer_3.model_max_length, T5_MAX_LENGTH)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "transformer":
            return list(self.transformer.transformer_blocks)
        if part in ("text_encoder", "text_encoder_2"):
            return clip_encoder_layers(self.parts[part])
        if part == "text_encoder_3":
            return list(self.parts[part].encoder.block)
        return []

    # --- data --------------------------------------------------------------------------------

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        return encode_latents(self.parts["vae"], pixels, self.compute_dtype("vae"), shifted=True)

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        t5 = self.tokenizer_3(captions, padding="max_length", max_length=self.max_sequence_length,
                              truncation=True, add_special_tokens=True, return_tensors="pt").input_ids
        return {"input_ids": clip_input_ids(self.tokenizer, captions),
                "input_ids_2": clip_input_ids(self.tokenizer_2, captions), "input_ids_3": t5}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # as StableDiffusion3Pipeline.encode_prompt: both CLIPs' penultimate hidden states side by
        # side, zero-padded to T5's width, then T5's last hidden states after them in the sequence;
        # the pooled embedding is both CLIPs' projections side by side
        clip_l, clip_g, t5 = (self.parts[p] for p in self.text_parts)
        out_l = clip_l(tokens["input_ids"].to(compute_device(clip_l)), output_hidden_states=True)
        out_g = clip_g(tokens["input_ids_2"].to(compute_device(clip_g)), output_hidden_states=True)
        dtype = out_l.hidden_states[-2].dtype
        t5_hidden = t5(tokens["input_ids_3"].to(compute_device(t5)))[0].to(dtype)
        clip_hidden = torch.cat([out_l.hidden_states[-2], out_g.hidden_states[-2].to(dtype)], dim=-1)
        clip_hidden = torch.nn.functional.pad(clip_hidden, (0, t5_hidden.shape[-1] - clip_hidden.shape[-1]))
        return {"hidden_states": torch.cat([clip_hidden, t5_hidden.to(clip_hidden.device)], dim=-2),
                "pooled": torch.cat([out_l.text_embeds, out_g.text_embeds.to(out_l.text_embeds.dtype)], dim=-1)}

    def planning_tokens(self, batch, device):
        clip_l, clip_g, _t5 = (self.parts[p] for p in self.text_parts)
        return {"input_ids": self.planning_ids(batch, clip_window(getattr(self, "tokenizer", None), clip_l), device),
                "input_ids_2": self.planning_ids(batch, clip_window(getattr(self, "tokenizer_2", None), clip_g),
                                                 device),
                "input_ids_3": self.planning_ids(batch, self.planning_length(T5_MAX_LENGTH), device)}

    def planning_conditioning(self, batch, device):
        clip_l, clip_g, t5 = (self.parts[p] for p in self.text_parts)
        window = clip_window(getattr(self, "tokenizer", None), clip_l)
        dtype = self.compute_dtype("text_encoder")
        length = window + self.planning_length(T5_MAX_LENGTH)
        return {"hidden_states": torch.empty(batch, length, t5.config.d_model, dtype=dtype, device=device),
                "pooled": torch.empty(batch, clip_l.config.projection_dim + clip_g.config.projection_dim,
                                      dtype=dtype, device=device)}

    # --- training ----------------------------------------------------------------------------

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow velocity (noise - clean) the transformer predicts; its timestep is sigma * 1000
        (the scheduler's num_train_timesteps), as StableDiffusion3Pipeline passes it."""
        dtype = self.compute_dtype("transformer")
        steps = self.noise_scheduler.config.num_train_timesteps
        return self.transformer(
            hidden_states=noisy.to(dtype), timestep=(sigmas * steps).to(dtype),
            encoder_hidden_states=text["hidden_states"].to(dtype), pooled_projections=text["pooled"].to(dtype),
            return_dict=False,
        )[0]

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline(
            transformer=self.transformer,
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(self.noise_scheduler.config),
            vae=self.parts["vae"], text_encoder=self.parts["text_encoder"], tokenizer=self.tokenizer,
            text_encoder_2=self.parts["text_encoder_2"], tokenizer_2=self.tokenizer_2,
            text_encoder_3=self.parts["text_encoder_3"], tokenizer_3=self.tokenizer_3,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def run_sampling_pipeline(self, prompt, device):
        generator = make_generator(device, prompt.seed)
        return self.pipeline()(
            prompt=self.written_out_prompt(prompt.prompt),
            negative_prompt=self.written_out_prompt(prompt.negative_prompt) or None,
            num_inference_steps=prompt.steps, guidance_scale=prompt.cfg, width=prompt.width, height=prompt.height,
            generator=generator, max_sequence_length=self.max_sequence_length,
        ).images[0]

    # --- adapters: what other tools do with the files (the key layout itself: keys/sd3.py) ------

    def diffusers_skips_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        if part == "text_encoder_3":
            return "StableDiffusion3Pipeline.load_lora_weights loads no T5 adapters (model.parts.text_encoder_3.train)"
        if fmt != "diffusers":
            return ("StableDiffusion3Pipeline.load_lora_weights reads only diffusers-format files "
                    "(output.format 'diffusers')")
        return None
