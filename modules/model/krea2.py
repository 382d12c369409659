"""Krea-2 (krea/Krea-2-Raw and its few-step distilled checkpoint): a 12.8B single-stream MMDiT
(Krea2Transformer2DModel, 28 blocks at 6144 wide, grouped-query attention with a sigmoid output
gate, SwiGLU), the Qwen3-VL-4B language model as text encoder read at twelve of its hidden states,
and Qwen-Image's AutoencoderKLQwenImage (16 latent channels, one frame). Every fact below is
Krea2Pipeline's (diffusers 0.42, pipelines/krea2/pipeline_krea2.py), reproduced so training sees
what sampling sees:

- prompt: Qwen-Image's system line and user header, the caption, padding to a fixed length, then
  the assistant suffix (`[prefix | caption | PAD | suffix]`, `get_text_hidden_states`); the
  language model runs with positions that count real tokens only (padding takes no position, so
  the suffix's mRoPE phase does not depend on the padding), and the hidden states at the model
  index's `text_encoder_select_layers` (default 2, 5, ..., 35 of Qwen3-VL-4B's 37) are stacked per
  token, (B, L, 12, 2560); the template's first 34 tokens are dropped, with a bool mask of the
  real ones. The transformer's text-fusion stage collapses the layer axis; padded text tokens are
  masked as attention keys (a caption padded further predicts the same).
- latents: the VAE's mean on (B, 3, 1, H, W) frames, normalised per channel by the config's
  `latents_mean` / `latents_std`, as Qwen-Image; packed in `patch_size` (model index, 2) square
  patches; position ids (0, row, column) for the image, zeros for the text (`prepare_position_ids`).
- rectified flow: the transformer takes sigma itself (the pipeline passes timestep / 1000) and
  predicts noise - latents. The base model's sampler shifts its sigmas exponentially by mu from the
  image's token count (the scheduler config's base/max_image_seq_len 256/6400 and shift
  0.5/1.15); the distilled checkpoint (model index `is_distilled`) by the fixed mu 1.15. Training
  draws logit-normal times shifted the same way (loss.flow_shift sets a fixed shift instead).
- sampling: the family's own embeddings handed to the pipeline; CFG against the negative prompt
  (empty if none) when the prompt's cfg is above 1. Krea2Pipeline's `guidance_scale` g computes
  cond + g (cond - uncond), the usual CFG at scale 1 + g: a prompt's cfg s is passed as g = s - 1
  (the pipeline's default 4.5 is cfg 5.5; the distilled checkpoint samples at cfg 1, no CFG).

Only the language model of Qwen3-VL is loaded (Qwen3VLTextModel, 4.02B): the vision tower never
touches a text prompt. Its layers after the last tapped one never reach the loss (no adapters).
Adapter key names: modules/model/keys/krea2.py. A single transformer file (the original Krea 2
layout, bare or under `model.diffusion_model.`) is converted by diffusers' Krea 2 converter and
read as the base model (the released model index); text encoder and VAE come from folders. The
distilled (Turbo) file has Raw's keys: a transformer file named *turbo* or *distill* is read as
distilled (fixed shift, no CFG at cfg 1), any other as Raw.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection

import torch

from modules.config.families.krea2 import DECLARATION
from modules.loading.diffusers_folder import ModelLoadError
from modules.model.base import ModelFamily, numbered_blocks
from modules.model.components.flow_matching import FlowMatchingTraining, flow_sigmas
from modules.model.keys.krea2 import KREA2_KEYS
from modules.model.qwen_image import latent_normalisation
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator

# Krea2Pipeline's prompt_template_encode_prefix / _suffix, prompt_template_encode_start_idx and
# prompt_template_encode_num_suffix_tokens
PROMPT_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
PROMPT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
TEMPLATE_TOKENS_DROPPED = 34
SUFFIX_TOKENS = 5
# the pipeline's default `max_sequence_length`: text tokens after the drop, suffix included
MAX_TEXT_TOKENS = 512
# Krea2Pipeline's default taps of Qwen3-VL-4B's hidden states (0 is the embedding output)
DEFAULT_SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)
# the distilled checkpoint's fixed timestep shift (Krea2Pipeline.__call__)
DISTILLED_MU = 1.15
# a single file of the distilled checkpoint has Raw's keys and shapes; only its name tells it apart
# (Krea's own turbo.safetensors, ComfyUI's krea2_turbo_*; "distilled" in community names)
DISTILLED_FILE_WORDS = ("turbo", "distill")


def _text_encoder_key(key: str) -> str:
    # a Qwen3VLModel folder holds the language model under `language_model.`, a
    # Qwen3VLForConditionalGeneration one under `model.language_model.`; the vision tower is ignored
    for prefix in ("model.language_model.", "language_model.", "model."):
        if key.startswith(prefix):
            return key.removeprefix(prefix)
    return key


def _pipeline_class():
    from diffusers import Krea2Pipeline

    return Krea2Pipeline


class Krea2Family(FlowMatchingTraining, ModelFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/
    pipeline_classes = ("Krea2Pipeline",)
    denoiser_config = {"_class_name": "Krea2Transformer2DModel"}
    # the original Krea 2 layout, bare or under model.diffusion_model. (diffusers' CHECKPOINT_KEY_NAMES["krea2"])
    single_file_signature = (r"^(model\.diffusion_model\.)?txtfusion\.projector\.weight$", None)
    kohya_base_version = "krea2"
    modelspec_architecture = "krea-2/lora"
    key_layout = KREA2_KEYS
    # Krea-2: 28 blocks at 6144 wide; Qwen3-VL-4B's language model; Qwen-Image's VAE
    nominal_part_parameters = {"text_encoder": 4_022_468_096, "transformer": 12_820_073_036, "vae": 126_892_531}
    text_parts = ("text_encoder",)
    # textual inversion into Qwen3-VL-4B's token table, under ComfyUI's Krea 2 key (comfy/text_encoders/krea2.py)
    embedding_slots = {"text_encoder": ("tokenizer", "qwen3vl_4b")}
    image_parts = ("vae",)
    # (L, 12, width) per caption: the text cache keeps its real tokens, the suffix's too, in order
    # (tests/test_family_krea2.py: padding tokens are masked; tests/test_text_padding.py)
    masked_text_padding = {"hidden_states": ("attention_mask", 0)}

    def load(self) -> None:
        from diffusers import AutoencoderKLQwenImage, Krea2Transformer2DModel
        from transformers import AutoTokenizer, Qwen3VLTextModel

        self.parts["text_encoder"] = self.load_part(
            "text_encoder", Qwen3VLTextModel, rename=_text_encoder_key,
            ignore_unexpected=[r"^(model\.)?visual\.", r"^lm_head\."])
        self.parts["transformer"] = self.load_part("transformer", Krea2Transformer2DModel)
        self.parts["vae"] = self.load_part("vae", AutoencoderKLQwenImage)
        self.load_flow_scheduler()
        index = self._model_index()
        self.select_layers = tuple(index.get("text_encoder_select_layers") or DEFAULT_SELECT_LAYERS)
        self.is_distilled = bool(index.get("is_distilled", False)) or self._distilled_file()
        self.patch_size = int(index.get("patch_size", 2))
        self._check_select_layers()
        folder = self.support_folder("tokenizer")
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self._check_template_split(folder)

    def _model_index(self) -> dict:
        # beside the scheduler: the diffusers folder's, or for a single file the released one
        index = self.support_folder("scheduler").parent / "model_index.json"
        if not index.is_file():
            return {}
        try:
            return json.loads(index.read_text(encoding="utf-8"))
        except ValueError as error:
            raise ModelLoadError(f"model.base: cannot read {index}: {error}") from None

    def _distilled_file(self) -> bool:
        # a single transformer file is read with the released (Raw) model index: its name decides
        file = self.part_file("transformer")
        return file is not None and any(word in file.stem.lower() for word in DISTILLED_FILE_WORDS)

    def _check_select_layers(self) -> None:
        taps, layers = len(self.select_layers), self.transformer.config.num_text_layers
        deepest = self.parts["text_encoder"].config.num_hidden_layers
        if taps != layers or not all(0 <= i <= deepest for i in self.select_layers):
            raise ModelLoadError(
                f"model.base: model_index.json's text_encoder_select_layers {list(self.select_layers)} must name "
                f"{layers} hidden states (the transformer's num_text_layers) of the text encoder's 0..{deepest}")

    def _check_template_split(self, folder) -> None:
        # the 34 dropped and 5 suffix tokens are Qwen's tokenizer's split of the template; another
        # tokenizer would drop part of the caption or keep part of the template
        prefix = len(self.tokenizer(PROMPT_PREFIX, add_special_tokens=False).input_ids)
        suffix = len(self.tokenizer(PROMPT_SUFFIX, add_special_tokens=False).input_ids)
        if (prefix, suffix) != (TEMPLATE_TOKENS_DROPPED, SUFFIX_TOKENS):
            raise ModelLoadError(
                f"model.base: the tokenizer in {folder} splits Krea-2's prompt template into {prefix} tokens before "
                f"the caption and {suffix} after it, where Krea2Pipeline counts {TEMPLATE_TOKENS_DROPPED} and "
                f"{SUFFIX_TOKENS}: not Qwen's tokenizer")

    def single_file_part(self, part: str):
        # the original Krea 2 transformer file; the text encoder and VAE ship apart
        from diffusers.loaders import single_file_utils as convert

        from modules.loading.single_file import SingleFilePart

        if part != "transformer":
            return None
        return SingleFilePart(
            ("model.diffusion_model.", "blocks.", "first.", "tmlp.", "tproj.", "txtmlp.", "txtfusion.", "last."),
            lambda sd, model: convert.convert_krea2_transformer_checkpoint_to_diffusers(dict(sd)))

    @property
    def transformer(self):
        return self.parts["transformer"]

    @property
    def max_sequence_length(self) -> int:
        """Text tokens the transformer sees (the template's drop done, the suffix included)."""
        return min(self.tokenizer.model_max_length - TEMPLATE_TOKENS_DROPPED, MAX_TEXT_TOKENS)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "transformer":  # in the order forward() runs them
            fusion = self.transformer.text_fusion
            return [*fusion.layerwise_blocks, *fusion.refiner_blocks, *self.transformer.transformer_blocks]
        if part == "text_encoder":
            return list(self.parts[part].layers)
        return []

    def unreachable_prefixes(self, part: str, names: Collection[str] | None = None) -> tuple[str, ...]:
        # hidden_states[k] is the output of layer k - 1: the layers from the deepest tap on reach nothing
        if part != "text_encoder":
            return super().unreachable_prefixes(part, names)
        blocks, count = numbered_blocks(self._module_names(part, names), "layers")
        deepest = max(getattr(self, "select_layers", DEFAULT_SELECT_LAYERS))
        return tuple(f"{blocks}.{i}." for i in range(deepest, count))

    # --- data --------------------------------------------------------------------------------

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        vae = self.parts["vae"]
        latents = vae.encode(pixels.to(self.compute_dtype("vae")).unsqueeze(2)).latent_dist.mean  # one frame
        mean, std = latent_normalisation(vae, latents)
        return ((latents - mean) / std).squeeze(2)

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        # as Krea2Pipeline.get_text_hidden_states: prefix + caption padded (on the right) to a fixed
        # length, then the suffix after the padding
        length = self.max_sequence_length + TEMPLATE_TOKENS_DROPPED - SUFFIX_TOKENS
        text = self.tokenizer([PROMPT_PREFIX + c for c in captions], truncation=True, padding="max_length",
                              max_length=length, padding_side="right", return_tensors="pt")
        suffix = self.tokenizer([PROMPT_SUFFIX] * len(captions), return_tensors="pt")
        return {"input_ids": torch.cat([text.input_ids, suffix.input_ids], dim=1),
                "attention_mask": torch.cat([text.attention_mask, suffix.attention_mask], dim=1)}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoder = self.parts["text_encoder"]
        mask = tokens["attention_mask"].to(compute_device(encoder)).bool()
        # positions count real tokens only, the same on mRoPE's three axes
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
        out = encoder(input_ids=tokens["input_ids"].to(compute_device(encoder)), attention_mask=mask, position_ids=positions,
                      output_hidden_states=True, use_cache=False)
        hidden = torch.stack([out.hidden_states[i] for i in self.select_layers], dim=2)
        return {"hidden_states": hidden[:, TEMPLATE_TOKENS_DROPPED:],
                "attention_mask": mask[:, TEMPLATE_TOKENS_DROPPED:].long()}

    def planning_tokens(self, batch, device):
        # the template's prefix, the caption window and the suffix (tokenize: the window includes the suffix)
        length = TEMPLATE_TOKENS_DROPPED + self.planning_length(MAX_TEXT_TOKENS)
        return {"input_ids": self.planning_ids(batch, length, device),
                "attention_mask": torch.ones(batch, length, dtype=torch.long, device=device)}

    def planning_conditioning(self, batch, device):
        length = self.planning_length(MAX_TEXT_TOKENS)
        taps = len(getattr(self, "select_layers", DEFAULT_SELECT_LAYERS))
        return {"hidden_states": torch.empty(batch, length, taps, self.parts["text_encoder"].config.hidden_size,
                                             dtype=self.compute_dtype("text_encoder"), device=device),
                "attention_mask": torch.empty(batch, length, dtype=torch.long, device=device)}

    # --- training ----------------------------------------------------------------------------

    def sequence_length(self, latents: torch.Tensor) -> int:
        p = self.patch_size
        return (latents.shape[-2] // p) * (latents.shape[-1] // p)

    def sample_sigmas(self, batch: int, sequence_length: int, generator: torch.Generator) -> torch.Tensor:
        unit = self.training_times(batch, generator)
        if self.config.loss.flow_shift is not None or not self.is_distilled:
            return flow_sigmas(self.noise_scheduler.config, unit, sequence_length, self.config.loss.flow_shift)
        # the distilled checkpoint's fixed mu, in the scheduler's exponential time shift
        return math.exp(DISTILLED_MU) / (math.exp(DISTILLED_MU) + (1 / unit - 1))

    def _pack(self, latents: torch.Tensor) -> torch.Tensor:
        # Krea2Pipeline._pack_latents
        b, c, h, w = latents.shape
        p = self.patch_size
        return latents.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)

    def _unpack(self, packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
        b, _, d = packed.shape
        p = self.patch_size
        c = d // (p * p)
        return packed.view(b, height // p, width // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, height, width)

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's velocity prediction (noise - latents) for (B, C, H, W) latents at `sigmas`."""
        dtype = self.compute_dtype("transformer")
        _, _, height, width = noisy.shape
        hidden = text["hidden_states"].to(noisy.device, dtype)
        p = self.patch_size
        positions = _pipeline_class().prepare_position_ids(hidden.shape[1], height // p, width // p, noisy.device)
        out = self.transformer(
            hidden_states=self._pack(noisy).to(dtype), encoder_hidden_states=hidden, timestep=sigmas.to(dtype),
            position_ids=positions, encoder_attention_mask=text["attention_mask"].to(noisy.device).bool(),
            return_dict=False,
        )[0]
        return self._unpack(out, height, width)

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        pipe = _pipeline_class()(
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(self.noise_scheduler.config),
            vae=self.parts["vae"], text_encoder=self.parts["text_encoder"], tokenizer=self.tokenizer,
            transformer=self.transformer, text_encoder_select_layers=self.select_layers,
            is_distilled=self.is_distilled, patch_size=self.patch_size,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _prompt_conditioning(self, prompt: str, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings, mask) as training computes them, on the sampling device in the transformer's
        dtype (the pipeline draws its latents in the embeddings' dtype)."""
        text = self.encode_text(self.tokenize([self.written_out_prompt(prompt)]))  # placeholders written out
        return (text["hidden_states"].to(device, self.sampling_dtype("transformer")),
                text["attention_mask"].to(device).bool())

    def run_sampling_pipeline(self, prompt, device):
        embeds, mask = self._prompt_conditioning(prompt.prompt, device)
        negative = {}
        guidance = max(prompt.cfg - 1.0, 0.0)  # Krea2Pipeline's cond + g (cond - uncond): CFG at 1 + g
        if guidance > 0:
            embeds_n, mask_n = self._prompt_conditioning(prompt.negative_prompt or "", device)
            negative = {"negative_prompt_embeds": embeds_n, "negative_prompt_embeds_mask": mask_n}
        return self.pipeline()(
            prompt_embeds=embeds, prompt_embeds_mask=mask, guidance_scale=guidance,
            num_inference_steps=prompt.steps, width=prompt.width, height=prompt.height,
            generator=make_generator(device, prompt.seed), max_sequence_length=self.max_sequence_length, **negative,
        ).images[0]

    # --- adapters: what other tools do with the files (the key layout itself: keys/krea2.py) ---

    def diffusers_refuses_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        # every key must hold "lora": a kohya file's text-encoder alphas (text_encoders.qwen3vl_4b...alpha) do not
        if fmt == "kohya" and part == "text_encoder":
            return ("Krea2LoraLoaderMixin refuses a file with a key without 'lora' in its name: the Qwen3-VL "
                    "adapters' alphas under ComfyUI's text_encoders. names (model.parts.text_encoder.train false)")
        return None

    def diffusers_skips_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        if part == "text_encoder" and fmt != "kohya":
            return ("Krea2Pipeline.load_lora_weights loads the transformer's adapters only "
                    "(model.parts.text_encoder.train)")
        if fmt == "kohya" and part == "transformer":
            return ("Krea2LoraLoaderMixin has no rule for kohya's lora_unet_ names and loads nothing from such a file "
                    "(output.format 'diffusers' loads in both diffusers and ComfyUI)")
        return None
