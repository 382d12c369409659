"""Wan 2.1 text-to-video (Wan-AI/Wan2.1-T2V-1.3B and 14B): the UMT5-XXL encoder, WanTransformer3DModel
(a DiT over (1, 2, 2) patches of video latents, self-attention, cross-attention to the text, FFN per
block) and the causal 3D video VAE AutoencoderKLWan (16 channels, 8x spatial and 4x temporal
compression: 1 + 4n frames become 1 + n latent frames). Every fact below is WanPipeline's
(diffusers 0.42, pipelines/wan/pipeline_wan.py), reproduced so training sees what sampling sees:

- prompt: cleaned as the pipeline does (`prompt_clean`), tokenized to 512 tokens (or the tokenizer's
  limit) with the end token; UMT5's last hidden states with the padded positions zeroed (the
  transformer takes all 512, no mask, as the pipeline hands them).
- latents: the VAE's mean on (B, 3, F, H, W) frames, normalised per channel by the config's
  `latents_mean` / `latents_std`; a still image is a one-frame video (latents (B, C, H, W) here,
  one latent frame to the transformer).
- rectified flow: the transformer takes the timestep sigma * 1000 (the scheduler's timesteps) and
  predicts noise - latents (UniPC's `flow_prediction`); training sigmas are shifted by the
  scheduler config's `flow_shift` (3.0 in the released 480p config; loss.flow_shift overrides).
- sampling: WanPipeline with its own UniPC scheduler on the family's embeddings, CFG against a
  negative prompt (empty if none) when cfg > 1.

Adapter key names (ComfyUI's and musubi-tuner's original Wan names): modules/model/keys/wan.py.
Single files (Wan-AI's and ComfyUI's transformer, VAE and UMT5 files): modules/model/wan_single_file.py.
"""

from __future__ import annotations

import re

import torch

from modules.config.families.wan import DECLARATION
from modules.model.base import ModelFamily
from modules.model.components.flow_matching import FlowMatchingTraining, flow_sigmas
from modules.model.keys.wan import DIFFUSERS_READS_BLOCK_LAYER, WAN_KEYS
from modules.model.wan_single_file import PART_SIGNATURES, SIGNATURE
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator

# WanPipeline's default `max_sequence_length`
MAX_TEXT_TOKENS = 512


def latent_normalisation(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the VAE's latents per channel, shaped (1, C, 1, 1, 1) like `like`."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    std = torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, std


class WanFamily(FlowMatchingTraining, ModelFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/wan.py
    pipeline_classes = ("WanPipeline",)
    denoiser_config = {"_class_name": "WanTransformer3DModel", "in_channels": 16}  # (I2V: 36)
    single_file_signature = SIGNATURE
    single_file_part_signatures = PART_SIGNATURES
    temporal_quantum = 4  # the VAE's 4x in time: 1 + 4n frames
    kohya_base_version = "wan_2.1_t2v"
    modelspec_architecture = "wan-2.1-t2v/lora"
    key_layout = WAN_KEYS
    # Wan 2.1 T2V 1.3B (30 blocks at 1536 wide); the 14B has 14_288_491_584; UMT5-XXL's encoder;
    # the Wan 2.1 VAE (counted from resources/model_configs/wan/ on the meta device)
    nominal_part_parameters = {"text_encoder": 5_680_910_336, "transformer": 1_418_996_800, "vae": 126_892_531}
    text_parts = ("text_encoder",)
    # ComfyUI's UMT5-XXL embedding key (its Wan text encoder's tokenizer: embedding_key 'umt5xxl')
    embedding_slots = {"text_encoder": ("tokenizer", "umt5xxl")}
    image_parts = ("vae",)
    transformer_parts = ("transformer",)  # the parts a transformer single file may hold (wan22: both experts)

    @classmethod
    def released_variant(cls, preset_name: str) -> str | None:
        # Wan 2.1 T2V comes in two sizes: the released configs' transformer/ is the 1.3B's,
        # transformer_14b/ the 14B's (what a "14B" preset is sized for)
        return "14b" if re.search(r"\b14B\b", preset_name) else None

    def load(self) -> None:
        from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
        from transformers import AutoTokenizer, UMT5EncoderModel

        if self.single_file is not None:
            self.single_file_stream()  # which parts the file holds, and its transformer's shape, before any weight
        self.parts["text_encoder"] = self.load_part("text_encoder", UMT5EncoderModel)
        self.parts["transformer"] = self.load_part("transformer", WanTransformer3DModel)
        self.parts["vae"] = self.load_part("vae", AutoencoderKLWan)
        # the released Wan 2.1 folders ship UniPC with flow sigmas; its flow_shift is the training shift too
        # (read before the tokenizer, which resources/model_configs/wan lacks: the planner needs the shift)
        self.noise_scheduler = UniPCMultistepScheduler.from_pretrained(
            str(self.support_folder("scheduler")), local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.support_folder("tokenizer")), local_files_only=True)

    def single_file_part(self, part: str):
        from modules.model import wan_single_file

        return wan_single_file.single_file_part(part)

    def _check_single_file_parts(self) -> None:
        super()._check_single_file_parts()
        for spec in self.part_specs:  # the parts' own files too (a low-noise expert's, a VAE's), opened and checked
            if self.config.model.parts[spec.name].path and self.from_single_file(spec.name):
                self.single_file_stream(spec.name)

    def check_part_file(self, part: str, stream, where: str) -> None:
        # a transformer file of a shape no released config has (1.3B, 5B, I2V), a VAE file of the other Wan VAE
        from modules.model import wan_single_file

        if part in self.transformer_parts:
            wan_single_file.transformer_config_folder(
                super().part_folder(part), *wan_single_file.transformer_shape(stream.keys(), stream.shape), where=where)
        elif part == "vae":
            wan_single_file.check_vae_file(stream, super().part_folder(part), where, self.label)

    def part_folder(self, part: str):
        # a single transformer file is built from the shipped config of the size it holds (1.3B, 14B)
        folder = super().part_folder(part)
        if part not in self.transformer_parts or not self.from_single_file(part):
            return folder
        from modules.loading.diffusers_folder import ModelLoadError
        from modules.model import wan_single_file

        from modules.loading.single_file import open_single_file

        from_base = self.part_file(part) == self.single_file
        try:
            # the base file's header alone: which parts it holds is checked after (and asks this method)
            stream = (self._single_file_stream or open_single_file(self.single_file)) if from_base else (
                self.single_file_stream(part))
        except ModelLoadError:  # an unreadable file: the load itself says so, naming it
            return folder
        where = "model.base" if from_base else f"model.parts.{part}.path"
        return wan_single_file.transformer_config_folder(
            folder, *wan_single_file.transformer_shape(stream.keys(), stream.shape), where=where)

    @property
    def transformer(self):
        return self.parts["transformer"]

    @property
    def max_sequence_length(self) -> int:
        return min(self.tokenizer.model_max_length, MAX_TEXT_TOKENS)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "transformer":
            return list(self.transformer.blocks)
        if part == "text_encoder":
            return list(self.parts[part].encoder.block)
        return []

    # --- data --------------------------------------------------------------------------------

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) images -> (B, C, H/8, W/8) one-frame latents; (B, 3, F, H, W) clips of 1 + 4n
        frames -> (B, C, 1 + n, H/8, W/8)."""
        vae = self.parts["vae"]
        video = pixels if pixels.dim() == 5 else pixels.unsqueeze(2)
        latents = vae.encode(video.to(self.compute_dtype("vae"))).latent_dist.mean
        mean, std = latent_normalisation(vae, latents)
        latents = (latents - mean) / std
        return latents if pixels.dim() == 5 else latents.squeeze(2)

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tokens = self.tokenizer([prompt_clean(c) for c in captions], padding="max_length",
                                max_length=self.max_sequence_length, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        return {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoder = self.parts["text_encoder"]
        mask = tokens["attention_mask"].to(compute_device(encoder))
        hidden = encoder(tokens["input_ids"].to(compute_device(encoder)), mask).last_hidden_state
        # as WanPipeline._get_t5_prompt_embeds: the real tokens' states, zeros after them
        return {"hidden_states": hidden * mask.unsqueeze(-1).to(hidden.dtype)}

    def latent_geometry(self) -> tuple[int, int]:
        import json

        config = json.loads((self.part_folder("vae") / "config.json").read_text(encoding="utf-8"))
        return config.get("z_dim", 16), config.get("scale_factor_spatial") or 8  # AutoencoderKLWan's defaults

    def caption_windows(self) -> list[tuple[object, int]]:
        return [(self.tokenizer, self.max_sequence_length)]

    def planning_tokens(self, batch, device):
        length = self.planning_length(MAX_TEXT_TOKENS)
        return {"input_ids": self.planning_ids(batch, length, device),
                "attention_mask": torch.ones(batch, length, dtype=torch.long, device=device)}

    def planning_conditioning(self, batch, device):
        length = self.planning_length(MAX_TEXT_TOKENS)
        return {"hidden_states": torch.empty(batch, length, self.parts["text_encoder"].config.d_model,
                                             dtype=self.compute_dtype("text_encoder"), device=device)}

    # --- training ----------------------------------------------------------------------------

    def sequence_length(self, latents: torch.Tensor) -> int:
        return 0  # Wan's shift is fixed (no dynamic shifting)

    def sample_sigmas(self, batch: int, sequence_length: int, generator: torch.Generator) -> torch.Tensor:
        shift = self.config.loss.flow_shift or self.noise_scheduler.config.get("flow_shift", 1.0)
        return flow_sigmas({}, self.training_times(batch, generator), sequence_length, shift)

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The velocity (noise - latents) for (B, C, H, W) one-frame or (B, C, F, H, W) latents."""
        return self.run_transformer("transformer", noisy, sigmas, text)

    def run_transformer(self, part: str, noisy: torch.Tensor, sigmas: torch.Tensor,
                        text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The velocity of transformer `part` (a family of several transformers picks one per sample)."""
        dtype = self.compute_dtype(part)
        video = noisy if noisy.dim() == 5 else noisy.unsqueeze(2)
        hidden, extra = self.transformer_input(video, text, dtype)
        timestep = sigmas.float() * self.noise_scheduler.config.num_train_timesteps
        out = self.parts[part](hidden_states=hidden, timestep=timestep,
                               encoder_hidden_states=text["hidden_states"].to(dtype), return_dict=False, **extra)[0]
        return out if noisy.dim() == 5 else out.squeeze(2)

    def transformer_input(self, video: torch.Tensor, text: dict[str, torch.Tensor],
                          dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
        """The transformer's hidden_states for (B, C, F, H, W) noisy latents, and any further
        inputs (an image-to-video model's first frame: wan_first_frame.py)."""
        return video.to(dtype), {}

    # --- sampling ----------------------------------------------------------------------------

    # WanPipeline's config options for this model (Wan 2.2 TI2V: expand_timesteps)
    pipeline_options: dict = {}

    def pipeline(self):
        from diffusers import UniPCMultistepScheduler, WanPipeline

        pipe = WanPipeline(tokenizer=self.tokenizer, text_encoder=self.parts["text_encoder"], vae=self.parts["vae"],
                           scheduler=UniPCMultistepScheduler.from_config(self.noise_scheduler.config),
                           transformer=self.transformer, **self.pipeline_options)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _prompt_embeds(self, prompt: str, device) -> torch.Tensor:
        text = self.encode_text(self.tokenize([self.written_out_prompt(prompt)]))
        return text["hidden_states"].to(device, self.sampling_dtype("transformer"))

    def sample_frames(self, prompt, device, frames: int = 1) -> list:
        """The prompt's video as PIL frames (WanPipeline rounds `frames` to 1 + 4n)."""
        negative = {}
        if prompt.cfg > 1:
            negative = {"negative_prompt_embeds": self._prompt_embeds(prompt.negative_prompt or "", device)}
        return self.pipeline()(
            prompt_embeds=self._prompt_embeds(prompt.prompt, device), guidance_scale=prompt.cfg,
            num_inference_steps=prompt.steps, width=prompt.width, height=prompt.height, num_frames=frames,
            generator=make_generator(device, prompt.seed), max_sequence_length=self.max_sequence_length,
            output_type="pil", **negative,
        ).frames[0]

    def run_sampling_pipeline(self, prompt, device):
        return self.sample_frames(prompt, device, 1)[0]

    video_fps = 16.0  # Wan 2.1's frame rate (its 81-frame clips are 5 s)

    def run_video_pipeline(self, prompt, device):
        return self.sample_frames(prompt, device, prompt.frames)

    # --- adapters: what other tools do with the files (the key layout itself: keys/wan.py) ---

    def diffusers_skips_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        if part == "text_encoder" and fmt == "diffusers":
            return "WanPipeline.load_lora_weights loads the transformer's adapters only (model.parts.text_encoder.train)"
        return None

    def diffusers_refuses_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        # its non-diffusers converter must consume every key of the file ("state_dict should be empty")
        if part == "text_encoder" and fmt != "diffusers":
            return ("WanPipeline's kohya/ComfyUI converter must read every key and has no rule for UMT5 text-encoder "
                    "adapters (model.parts.text_encoder.train false, or output.format 'diffusers', which drops them)")
        if fmt == "kohya" and not DIFFUSERS_READS_BLOCK_LAYER.match(module_name):
            return ("its musubi-tuner Wan converter reads only the blocks' attention and FFN layers, all of them, "
                    "and raises on any other (adapter.layer_preset 'attn-mlp')")
        if fmt == "comfy" and not DIFFUSERS_READS_BLOCK_LAYER.match(module_name):
            return ("its Wan converter takes an `alpha` only for the blocks' layers and raises on one elsewhere "
                    "(adapter.layer_preset 'attn' or 'attn-mlp')")
        return None
