"""FLUX.2 [klein] (black-forest-labs/FLUX.2-klein-4B, -9B and their -base models), as diffusers'
Flux2KleinPipeline runs it:

- text: a Qwen3 encoder reads the caption as a chat user turn (generation prompt, thinking off),
  padded to 512 tokens; the hidden states after layers 9, 18 and 27 are stacked per token into one
  3x-wide vector (`_get_qwen3_prompt_embeds`). The transformer sees every token, padding included
  (the pipeline hands it no mask), so training does the same. Layers from the 28th on never reach
  the output: they get no adapters (unreachable_prefixes).
- latents: AutoencoderKLFlux2 (32 channels, 8x down) -> 2x2 patches as 128 channels
  (`_patchify_latents`) -> normalised by the VAE's batch-norm running mean and variance (`bn`,
  eps from the config). Each 128-channel position is one token (`_pack_latents`), with 4-axis
  position ids (t, h, w, l): images (0, h, w, 0), text (0, 0, 0, l).
- rectified flow: noisy = (1 - s) x + s noise, the transformer predicts noise - x from the
  timestep s (the pipeline passes t / 1000). The sampler shifts its schedule by
  `compute_empirical_mu(image tokens, steps)`; training draws logit-normal times shifted by that
  mu at the pipeline's default 50 steps (loss.flow_shift sets a fixed shift instead).
- guidance: [klein] has no guidance embedding; the base models sample with true CFG against the
  empty prompt, the step-distilled ones (model_index `is_distilled`) without.

FLUX.2 [dev] (black-forest-labs/FLUX.2-dev), as diffusers' Flux2Pipeline runs it, differs in:

- text: a Mistral-Small-3.1 encoder (Mistral3ForConditionalGeneration; only its language model
  runs) reads the caption as a user turn after the pipeline's fixed system message
  (`format_input`, no generation prompt), padded to 512 tokens by the processor's chat template;
  the hidden states after layers 10, 20 and 30 are stacked (`_get_mistral_3_small_prompt_embeds`).
- guidance: the transformer's guidance embedding gets `guidance_scale` while sampling (no
  negative prompt: guidance-distilled) and FLUX.1's training value (flux.TRAINING_GUIDANCE) while
  training.
Reference images (multi-reference editing, both variants): a concept with `controls` gives each
sample up to 4; their latents are encoded like the target's, packed and appended to its tokens at
time coordinates 10, 20, ... (the pipelines' `_prepare_image_ids`), and only the target's tokens
are predicted. `sampling.prompts[].control_images` go to the pipeline's `image=`.

The variant is the transformer's `guidance_embeds` (a single file: its guidance_in layers); the
text encoder class is its folder's config (`mistral3` or Qwen3). Adapter key names:
modules/model/keys/flux2.py.
"""

from __future__ import annotations

import json
import math
import re
from typing import Collection

import torch

from modules.config.families.flux2 import DECLARATION
from modules.loading.diffusers_folder import ModelLoadError
from modules.model import flux
from modules.model.base import ModelFamily, numbered_blocks
from modules.model.components import mistral3_text
from modules.model.components.flow_matching import FlowMatchingTraining, flow_sigmas
from modules.model.keys.flux2 import FLUX2_KEYS
from modules.sampling.control_images import fitted_control_images
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator


# Flux2KleinPipeline's defaults: the Qwen3 hidden states it stacks, the steps its mu is computed for
TEXT_ENCODER_OUT_LAYERS = (9, 18, 27)
DEFAULT_SAMPLING_STEPS = 50
# Flux2Pipeline's (FLUX.2 [dev]): the Mistral hidden states it stacks, its tokenizer_max_length
DEV_TEXT_ENCODER_OUT_LAYERS = (10, 20, 30)
MAX_SEQUENCE_LENGTH = 512


def embedding_key(hidden_size: int) -> str:
    """The text encoder's key in an embedding file, as ComfyUI names it (comfy/text_encoders/flux.py:
    KleinTokenizer's Qwen3Tokenizer has embedding_key 'qwen3_4b' at 2560 wide, for klein 4B's Qwen3-4B;
    Qwen3Tokenizer8B 'qwen3_8b' at 4096, for klein 9B's Qwen3-8B). Smaller test encoders read as 4B."""
    return "qwen3_8b" if hidden_size == 4096 else "qwen3_4b"


def _text_encoder_key(key: str) -> str:
    # the released encoder is a Qwen3ForCausalLM (`model.` level, lm_head); the Qwen3Model inside is enough
    return key.removeprefix("model.")


def _pipeline_class(dev: bool = False):
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    return Flux2Pipeline if dev else Flux2KleinPipeline


class Flux2Family(FlowMatchingTraining, ModelFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/
    pipeline_classes = ("Flux2KleinPipeline", "Flux2Pipeline")
    denoiser_config = {"_class_name": "Flux2Transformer2DModel"}
    # BFL's transformer file: the shared modulations (diffusers' own FLUX.2 key, single_file_utils);
    # [dev]'s has a guidance embedder too
    single_file_signature = (r"^(model\.diffusion_model\.)?single_stream_modulation\.lin\.", None)
    kohya_base_version = "flux2"
    key_layout = FLUX2_KEYS
    # FLUX.2-klein-4B: Qwen3-4B without lm_head, 5 double and 20 single blocks at 3072 wide, the 32-channel VAE
    nominal_part_parameters = {"text_encoder": 4_022_468_096, "transformer": 3_875_544_576, "vae": 84_046_115}
    text_parts = ("text_encoder",)
    image_parts = ("vae",)
    # the shared modulations make every block's shift/scale/gate (FLUX.1 keeps its per-block ones dense)
    quantize_skip_patterns = {"transformer": (r"^(double_stream_modulation_img|double_stream_modulation_txt|"
                                              r"single_stream_modulation)\.",)}
    # klein 4B's key; load() sets klein 9B's ('qwen3_8b') from the loaded encoder's width (embedding_key)
    embedding_slots = {"text_encoder": ("tokenizer", "qwen3_4b")}

    tiny_model_variants = ("klein", "dev")

    @classmethod
    def tiny_model_options(cls, preset_name: str) -> dict:
        return {"variant": "dev"} if re.search(r"\bdev\b", preset_name) else {}

    @classmethod
    def released_variant(cls, preset_name: str) -> str | None:
        # klein comes in two sizes: the released configs' plain folders are the 4B's, `*_klein_9b`
        # the 9B's (what a "9B" preset is sized for); [dev] presets keep the tiny stand-in's "dev"
        if re.search(r"\b9B\b", preset_name):
            return "klein_9b"
        return super().released_variant(preset_name)

    def load(self) -> None:
        from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
        from transformers import AutoProcessor, AutoTokenizer, Qwen3Model

        # both told by small config files, before any weights load
        self.is_dev = bool(self._part_config("transformer").get("guidance_embeds", True))  # diffusers' default
        mistral = mistral3_text.is_mistral3_config(self._part_config("text_encoder"))
        if mistral != self.is_dev:
            raise ModelLoadError(
                f"model.parts.text_encoder: the transformer is FLUX.2 {'[dev]' if self.is_dev else '[klein]'} "
                f"(guidance_embeds {self.is_dev}) but the text encoder in {self.part_folder('text_encoder')} is "
                f"{'Mistral3' if mistral else 'Qwen3'}; [dev] reads Mistral-Small-3.1, [klein] Qwen3")
        if mistral:
            self.embedding_slots = {}  # no embeddings on [dev]'s Mistral yet (embedding.py says so at setup)
            self.parts["text_encoder"] = self.load_part(
                "text_encoder", mistral3_text.Mistral3LanguageModel, rename=mistral3_text.language_model_key,
                ignore_unexpected=mistral3_text.UNUSED_KEYS)
        else:
            self.parts["text_encoder"] = self.load_part("text_encoder", Qwen3Model, rename=_text_encoder_key,
                                                        ignore_unexpected=[r"^lm_head\."])
            width = self.parts["text_encoder"].config.hidden_size
            self.embedding_slots = {"text_encoder": ("tokenizer", embedding_key(width))}
        self.parts["transformer"] = self.load_part("transformer", Flux2Transformer2DModel)
        self.parts["vae"] = self.load_part("vae", AutoencoderKLFlux2)
        self.load_flow_scheduler()
        self.is_distilled = self._read_is_distilled()
        # every part before the tokenizer, so a folder of configs alone builds them all (modules/plan/)
        # Flux2Pipeline's tokenizer for [dev] is the Pixtral processor (its chat template); a plain tokenizer works too
        tokenizer_class = AutoProcessor if mistral else AutoTokenizer
        self.tokenizer = tokenizer_class.from_pretrained(str(self.support_folder("tokenizer")), local_files_only=True)

    def _part_config(self, part: str) -> dict:
        config = self.part_folder(part) / "config.json"
        try:
            return json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"model.parts.{part}: cannot read {config}: {error}") from None

    @property
    def out_layers(self) -> tuple[int, ...]:
        return DEV_TEXT_ENCODER_OUT_LAYERS if getattr(self, "is_dev", False) else TEXT_ENCODER_OUT_LAYERS

    def _read_is_distilled(self) -> bool:
        # model_index.json says whether the model is step-distilled (no CFG); a single file: base
        index = self.support_folder("scheduler").parent / "model_index.json"
        if not index.is_file():
            return False
        return bool(json.loads(index.read_text(encoding="utf-8")).get("is_distilled", False))

    def part_folder(self, part: str):
        # a single transformer file is built from the shipped config of the model it holds: klein 4B
        # (`transformer/`), klein 9B (`transformer_klein_9b/`) or dev (`transformer_dev/`), told apart
        # by the file's double- and single-block counts
        folder = super().part_folder(part)
        if part != "transformer" or not self.from_single_file(part):
            return folder
        try:
            keys = self.single_file_stream(part).keys()
        except ModelLoadError:  # an unreadable file: the load itself says so, naming it
            return folder

        def count(blocks: str) -> int:
            pattern = re.compile(rf"(?:^|\.){blocks}\.(\d+)\.")
            return max({int(m.group(1)) for k in keys if (m := pattern.search(k))}, default=-1) + 1

        found = (count("double_blocks"), count("single_blocks"))
        for candidate in sorted(folder.parent.glob("transformer*/config.json")):
            config = json.loads(candidate.read_text(encoding="utf-8"))
            if (config["num_layers"], config["num_single_layers"]) == found:
                return candidate.parent
        return folder

    def single_file_part(self, part: str):
        # BFL ships the transformer as one original-layout file (ComfyUI's under model.diffusion_model.)
        from diffusers.loaders import single_file_utils as convert

        from modules.loading.single_file import SingleFilePart

        if part != "transformer":
            return None
        return SingleFilePart(
            ("model.diffusion_model.", "double_blocks.", "single_blocks.", "img_in.", "txt_in.", "time_in.",
             "guidance_in.", "double_stream_modulation_img.", "double_stream_modulation_txt.",
             "single_stream_modulation.", "final_layer."),
            lambda sd, model: convert.convert_flux2_transformer_checkpoint_to_diffusers(
                {k.removeprefix("model.diffusion_model."): v for k, v in sd.items()}))

    @property
    def modelspec_architecture(self) -> str:  # the size named, as musubi-tuner's Flux.2-klein-4b / -9b / dev
        if getattr(self, "is_dev", False):
            return "flux-2-dev/lora"
        return f"flux-2-klein-{'9b' if self.transformer.config.num_layers == 8 else '4b'}/lora"

    @property
    def transformer(self):
        return self.parts["transformer"]

    @property
    def max_sequence_length(self) -> int:
        # a processor (dev) keeps its tokenizer inside; a tiny test tokenizer is shorter than 512
        tokenizer = getattr(self.tokenizer, "tokenizer", self.tokenizer)
        return min(getattr(tokenizer, "model_max_length", MAX_SEQUENCE_LENGTH), MAX_SEQUENCE_LENGTH)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "transformer":
            return [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]
        if part == "text_encoder":
            return list(self.parts[part].layers)
        return []

    def unreachable_prefixes(self, part: str, names: Collection[str] | None = None) -> tuple[str, ...]:
        # hidden_states[k] is what layer k-1 outputs: layers from max(out layers) on are never read
        if part != "text_encoder":
            return ()
        blocks, count = numbered_blocks(self._module_names(part, names), "layers")
        return tuple(f"{blocks}.{i}." for i in range(max(self.out_layers), count))

    # --- data --------------------------------------------------------------------------------

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> the (B, 128, H/16, W/16) patchified, batch-norm-normalised latents
        (Flux2KleinPipeline._encode_vae_image, with the distribution's mean so a cache is stable)."""
        vae = self.parts["vae"]
        latents = vae.encode(pixels.to(self.compute_dtype("vae"))).latent_dist.mean
        latents = _pipeline_class()._patchify_latents(latents)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents)
        return (latents - mean) / std

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        if getattr(self, "is_dev", False):
            return self._tokenize_dev(captions)
        # as Flux2KleinPipeline._get_qwen3_prompt_embeds: a user turn, generation prompt, thinking off
        prompts = [self.tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                                      add_generation_prompt=True, enable_thinking=False)
                   for caption in captions]
        tokens = self.tokenizer(prompts, padding="max_length", max_length=self.max_sequence_length,
                                truncation=True, return_tensors="pt")
        return {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}

    def _tokenize_dev(self, captions: list[str]) -> dict[str, torch.Tensor]:
        # as Flux2Pipeline._get_mistral_3_small_prompt_embeds: its system message, then the caption as
        # a user turn (format_input drops "[IMG]"), no generation prompt, padded by the chat template call
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        tokens = self.tokenizer.apply_chat_template(
            format_input(prompts=captions, system_message=SYSTEM_MESSAGE), add_generation_prompt=False,
            tokenize=True, return_dict=True, return_tensors="pt", padding="max_length", truncation=True,
            max_length=self.max_sequence_length)
        return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoder = self.parts["text_encoder"]
        output = encoder(input_ids=tokens["input_ids"].to(compute_device(encoder)),
                         attention_mask=tokens["attention_mask"].to(compute_device(encoder)),
                         output_hidden_states=True, use_cache=False)
        stacked = torch.stack([output.hidden_states[k] for k in self.out_layers], dim=2)  # (B, L, 3, D)
        return {"hidden_states": stacked.flatten(2)}

    def planning_tokens(self, batch, device):
        length = self.planning_length(MAX_SEQUENCE_LENGTH)
        return {"input_ids": self.planning_ids(batch, length, device),
                "attention_mask": torch.ones(batch, length, dtype=torch.long, device=device)}

    def planning_conditioning(self, batch, device):
        width = self.parts["text_encoder"].config.hidden_size * len(self.out_layers)
        return {"hidden_states": torch.empty(batch, self.planning_length(MAX_SEQUENCE_LENGTH), width,
                                             dtype=self.compute_dtype("text_encoder"), device=device)}

    # --- training ----------------------------------------------------------------------------

    def sequence_length(self, latents: torch.Tensor) -> int:
        return latents.shape[-2] * latents.shape[-1]  # already 2x2 patches: one token per position

    def sample_sigmas(self, batch: int, sequence_length: int, generator: torch.Generator) -> torch.Tensor:
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        unit = self.training_times(batch, generator)
        if self.config.loss.flow_shift is not None:
            return flow_sigmas({}, unit, sequence_length, self.config.loss.flow_shift)
        # the scheduler's exponential time shift by the pipeline's mu (FlowMatchEulerDiscreteScheduler.time_shift)
        mu = compute_empirical_mu(sequence_length, DEFAULT_SAMPLING_STEPS)
        return math.exp(mu) / (math.exp(mu) + (1 / unit - 1))

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's velocity prediction for (B, 128, h, w) latents at `sigmas`. Reference
        images (`text["control_latents"]`, (B, N, 128, h', w'), when the samples have controls) join
        the sequence after the target's tokens as the pipelines put them: packed the same way, at
        time coordinate 10 + 10 i for the i-th (`_prepare_image_ids`); the output is cut back to the
        target's tokens, so the loss is on the target alone."""
        pipeline = _pipeline_class()
        dtype = self.compute_dtype("transformer")
        batch, channels, height, width = noisy.shape
        hidden = text["hidden_states"].to(noisy.device, dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:  # [dev]: FLUX.1's training value, float32 as the pipeline's
            guidance = torch.full((batch,), flux.TRAINING_GUIDANCE, device=noisy.device, dtype=torch.float32)
        tokens, ids = pipeline._pack_latents(noisy).to(dtype), pipeline._prepare_latent_ids(noisy).to(noisy.device)
        target_length = tokens.shape[1]
        controls = text.get("control_latents")
        if controls is not None:
            references = [controls[:, index].to(noisy.device, dtype) for index in range(controls.shape[1])]
            reference_ids = pipeline._prepare_image_ids([reference[:1] for reference in references])
            tokens = torch.cat([tokens, *(pipeline._pack_latents(reference) for reference in references)], dim=1)
            ids = torch.cat([ids, reference_ids.to(noisy.device).expand(batch, -1, -1)], dim=1)
        out = self.transformer(
            hidden_states=tokens, encoder_hidden_states=hidden, timestep=sigmas.to(noisy.device, dtype), img_ids=ids,
            txt_ids=pipeline._prepare_text_ids(hidden).to(noisy.device), guidance=guidance, return_dict=False,
        )[0][:, :target_length]
        return out.permute(0, 2, 1).reshape(batch, channels, height, width)  # _pack_latents undone

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        dev = getattr(self, "is_dev", False)
        pipe = _pipeline_class(dev)(
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(self.noise_scheduler.config),
            vae=self.parts["vae"], text_encoder=self.parts["text_encoder"], tokenizer=self.tokenizer,
            transformer=self.transformer, **({} if dev else {"is_distilled": getattr(self, "is_distilled", False)}),
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _prompt_embeds(self, prompt: str, device) -> torch.Tensor:
        # encoded as training encodes (the same facts as the pipeline's _get_qwen3_prompt_embeds, tested),
        # so the live Qwen3 with its adapters conditions the sample; on the sampling device: the
        # pipeline moves only prompts it encodes itself
        # (an embedding's placeholder written out as training writes captions out)
        return self.encode_text(self.tokenize([self.written_out_prompt(prompt)]))["hidden_states"].to(device)

    def run_sampling_pipeline(self, prompt, device):
        # reference images at the sample's size, as training brings controls to the target's bucket
        # (the pipeline keeps an image's own size up to 1 MP, cropped to multiples of 16)
        references = {}
        if prompt.control_images:
            references = {"image": fitted_control_images(prompt.control_images, prompt.width, prompt.height,
                                                         self.control_images, self.label)}
        if getattr(self, "is_dev", False):  # guidance-distilled: cfg is the guidance embedding's input, no negative
            return self.pipeline()(
                prompt_embeds=self._prompt_embeds(prompt.prompt, device), num_inference_steps=prompt.steps,
                guidance_scale=prompt.cfg, width=prompt.width, height=prompt.height,
                generator=make_generator(device, prompt.seed), max_sequence_length=self.max_sequence_length,
                **references,
            ).images[0]
        return self.pipeline()(
            prompt_embeds=self._prompt_embeds(prompt.prompt, device),
            negative_prompt_embeds=self._prompt_embeds(prompt.negative_prompt or "", device),
            num_inference_steps=prompt.steps, guidance_scale=prompt.cfg, width=prompt.width, height=prompt.height,
            generator=make_generator(device, prompt.seed), max_sequence_length=self.max_sequence_length, **references,
        ).images[0]

    # --- adapters: what other tools do with the files (the key layout itself: keys/flux2.py) -----

    # original layers diffusers' kohya-FLUX.2 converter has no rule for (it warns and drops them)
    _KOHYA_UNREAD = ("double_stream_modulation_", "single_stream_modulation.", "time_guidance_embed.guidance_embedder.",
                     "norm_out.linear")

    def diffusers_skips_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        if part == "text_encoder":
            return (f"{_pipeline_class(getattr(self, 'is_dev', False)).__name__}.load_lora_weights loads the "
                    "transformer's adapters only "
                    "(model.parts.text_encoder.train)")
        if stacked and module_name.startswith(self._KOHYA_UNREAD):
            return ("its kohya FLUX.2 converter has no rule for the modulation, guidance and final adaLN layers "
                    "(adapter.layer_preset 'attn' or 'attn-mlp' avoids them; output.format 'diffusers' keeps them)")
        return None
