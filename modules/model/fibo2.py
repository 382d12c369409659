"""Bria FIBO-2 (briaai/Fibo-2.0-dev and its turbo checkpoint), as diffusers' BriaFibo2Pipeline
(diffusers 0.42, pipelines/bria_fibo2/pipeline_bria_fibo2.py) generates an image from a caption:

- caption: the text as given (a .txt that may hold FIBO's structured JSON caption). A caption that
  parses as a JSON object is put in the form FIBO-2 was trained on, as the pipeline's __call__ does
  (`_parse_prompt`: empty values and the aesthetic/preference scores dropped, then serialized
  compactly); any other text is encoded as it is. No text is turned into JSON here.
- text: the caption in the pipeline's chat turn (`PROMPT_TEMPLATE`), through Qwen3-VL's language
  model; 18 of its hidden states, each scaled to unit RMS per token in float32, concatenated three at
  a time into six bundles (`TEXT_ENCODER_OUT_LAYERS`: the Perceiver's, then one per injection block),
  (B, 6, L, 3 x width), as `_get_qwen_prompt_embeds` computes them. Captions are padded on the right
  to a fixed window (`TEXT_WINDOW` tokens, so they batch and cache) with a mask of the real tokens:
  the transformer counts a prompt's gist tokens from the mask and masks the padding out of every
  attention, so padding changes nothing (tests/test_family_fibo2.py). Only the language model is
  loaded: a text prompt never reaches the vision tower, and layers from the 36th on are never read
  (no adapters there: unreachable_prefixes).
- latents: AutoencoderKLFlux2's mode, 2x2-patchified, normalised by the VAE's batch-norm statistics,
  and unpatchified back to (B, 32, H/8, W/8) (`prepare_image_latents`); the transformer patchifies
  them itself.
- rectified flow: noisy = (1 - s) x + s noise; the transformer takes the noise level s in [0, 1]
  (the pipeline passes t / 1000) and predicts noise - x (the scheduler's Euler step adds
  (s_next - s) times it). Training draws logit-normal times shifted as the model's
  FlowMatchEulerDiscreteScheduler config shifts its sampling schedule (by the image's token count
  where it shifts dynamically, `calculate_shift` as the pipeline computes mu), or by loss.flow_shift.
- sampling: the pipeline's own loop on embeddings encoded as training encodes them (the live
  encoder and its adapters); CFG as the pipeline does it when the prompt's cfg > 1: a second pass on
  the negative prompt, by default the null caption FIBO-2 was trained with (`DEFAULT_NEGATIVE_PROMPT`).

Not done here: the pipeline's images of a caption's `text_render` texts (drawn and shown to
Qwen3-VL once the noise level is at or below 0.9; training and samples encode the caption's text
alone, as the pipeline does for captions without text to render), and FIBO-2's editing mode.
Adapter key names: modules/model/keys/fibo2.py (diffusers' names: ComfyUI has no FIBO model).
"""

from __future__ import annotations

import json
from typing import Collection

import torch

from modules.config.families.fibo2 import DECLARATION
from modules.model.base import ModelFamily, numbered_blocks
from modules.model.components.flow_matching import FlowMatchingTraining
from modules.model.keys.fibo2 import FIBO2_KEYS
from modules.util.torch_utils import make_generator

# the tokens of a caption kept (the pipeline reads up to 4096; a prompt's gist-token count stops
# growing at the transformer's `gist_max_text_len`, 2048 as released)
TEXT_WINDOW = 2048
# the pipeline's bundles: 6 x 3 hidden states (kept here too where the planner reads them without diffusers)
BUNDLES, LAYERS_PER_BUNDLE = 6, 3


def _text_encoder_key(key: str) -> str:
    # Qwen3VLForConditionalGeneration files keep the language model under `model.language_model.`
    # (transformers-4 style files under `model.`); the vision tower (`visual.`) and lm_head are ignored
    for prefix in ("model.language_model.", "model."):
        if key.startswith(prefix):
            return key.removeprefix(prefix)
    return key


def trained_caption(text: str) -> str:
    """A caption as BriaFibo2Pipeline.__call__ hands it to the text encoder: a JSON object cleaned and
    serialized compactly (`_parse_prompt`), any other text unchanged."""
    from diffusers import BriaFibo2Pipeline

    caption, _ = BriaFibo2Pipeline._parse_prompt(text)
    if isinstance(caption, str):
        return text
    return json.dumps(caption or {}, separators=(",", ":"), ensure_ascii=False)


def _pipeline_facts():
    from diffusers.pipelines.bria_fibo2 import pipeline_bria_fibo2

    return pipeline_bria_fibo2


class Fibo2Family(FlowMatchingTraining, ModelFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/
    pipeline_classes = ("BriaFibo2Pipeline",)
    denoiser_config = {"_class_name": "BriaFibo2Transformer2DModel"}
    kohya_base_version = "fibo2"
    modelspec_architecture = "bria-fibo-2/lora"
    key_layout = FIBO2_KEYS
    # Fibo-2.0: the 8.1 B transformer (3584 wide, 44 blocks, 5 injection blocks, a 2-layer Perceiver),
    # Qwen3-VL-4B's language model (no vision tower, no lm_head), FLUX.2's 32-channel VAE
    nominal_part_parameters = {"text_encoder": 4_022_468_096, "transformer": 8_127_342_213, "vae": 84_046_115}
    text_parts = ("text_encoder",)
    # textual inversion into Qwen3-VL-4B's token table; ComfyUI has no FIBO: the key is the one its Krea 2
    # encoder reads for the same language model (comfy/text_encoders/krea2.py)
    embedding_slots = {"text_encoder": ("tokenizer", "qwen3vl_4b")}
    image_parts = ("vae",)
    # (6, L, 3 x width) per caption: the text cache keeps its real tokens (tests/test_family_fibo2.py:
    # padding changes nothing; tests/test_text_padding.py: the cache holds only them)
    masked_text_padding = {"hidden_states": ("attention_mask", 1)}

    def load(self) -> None:
        from diffusers import AutoencoderKLFlux2, BriaFibo2Transformer2DModel
        from transformers import AutoTokenizer, Qwen3VLTextModel

        self.parts["text_encoder"] = self.load_part(
            "text_encoder", Qwen3VLTextModel, rename=_text_encoder_key,
            ignore_unexpected=[r"^visual\.", r"^lm_head\."])
        self.parts["transformer"] = self.load_part("transformer", BriaFibo2Transformer2DModel)
        self.parts["vae"] = self.load_part("vae", AutoencoderKLFlux2)
        self.load_flow_scheduler()
        # the released processor/ folder is Qwen3VLProcessor's: for a text prompt it is its tokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.support_folder("processor")), local_files_only=True)

    @property
    def transformer(self):
        return self.parts["transformer"]

    @property
    def out_layers(self) -> tuple[tuple[int, ...], ...]:
        return _pipeline_facts().TEXT_ENCODER_OUT_LAYERS

    @property
    def max_sequence_length(self) -> int:
        return min(self.tokenizer.model_max_length, TEXT_WINDOW)

    def caption_windows(self) -> list[tuple[object, int]]:
        template = len(self.tokenizer(_pipeline_facts().PROMPT_TEMPLATE.format("")).input_ids)
        return [(self.tokenizer, self.max_sequence_length - template)]

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "transformer":  # in the order forward() runs them
            transformer = self.transformer
            return [*transformer.noise_refiner, *transformer.perceiver.layers, *transformer.layers]
        if part == "text_encoder":
            return list(self.parts[part].layers)
        return []

    def unreachable_prefixes(self, part: str, names: Collection[str] | None = None) -> tuple[str, ...]:
        # hidden_states[k] is what layer k-1 outputs: layers from the deepest one read on never reach the loss
        if part != "text_encoder":
            return ()
        deepest = max(max(bundle) for bundle in self.out_layers)
        blocks, count = numbered_blocks(self._module_names(part, names), "layers")
        return tuple(f"{blocks}.{i}." for i in range(deepest, count))

    # --- data --------------------------------------------------------------------------------

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> (B, 32, H/8, W/8) latents normalised as BriaFibo2Pipeline.prepare_image_latents does."""
        from diffusers import BriaFibo2Pipeline

        vae = self.parts["vae"]
        latents = vae.encode(pixels.to(self.compute_dtype("vae"))).latent_dist.mode()
        patches = BriaFibo2Pipeline._patchify_latents(latents)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(patches)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(patches)
        return BriaFibo2Pipeline._unpatchify_latents((patches - mean) / std)

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        return self._tokenize_as_given([trained_caption(c) for c in captions])

    def embedding_probe_captions(self, placeholder: str) -> list[str]:
        # a JSON caption is cleaned and reserialized (trained_caption): the placeholder in one of its values too
        return [placeholder, json.dumps({"short_description": f"a {placeholder} photo"})]

    def _tokenize_as_given(self, texts: list[str]) -> dict[str, torch.Tensor]:
        template = _pipeline_facts().PROMPT_TEMPLATE
        tokens = self.tokenizer([template.format(text) for text in texts], padding="max_length",
                                max_length=self.max_sequence_length, truncation=True, padding_side="right",
                                return_tensors="pt")
        return {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoder = self.parts["text_encoder"]
        mask = tokens["attention_mask"].to(encoder.device)
        hidden = encoder(input_ids=tokens["input_ids"].to(encoder.device), attention_mask=mask,
                         output_hidden_states=True, use_cache=False).hidden_states
        # as _get_qwen_prompt_embeds: each layer at unit RMS per token (in float32), three per bundle
        dtype = hidden[0].dtype
        normalized = {}
        for layer in sorted({layer for bundle in self.out_layers for layer in bundle}):
            states = hidden[layer].float()
            normalized[layer] = (states * torch.rsqrt(states.pow(2).mean(dim=-1, keepdim=True) + 1e-6)).to(dtype)
        bundles = [torch.cat([normalized[layer] for layer in bundle], dim=-1) for bundle in self.out_layers]
        return {"hidden_states": torch.stack(bundles, dim=1), "attention_mask": mask}

    def planning_tokens(self, batch, device):
        length = self.planning_length(TEXT_WINDOW)
        return {"input_ids": self.planning_ids(batch, length, device),
                "attention_mask": torch.ones(batch, length, dtype=torch.long, device=device)}

    def planning_conditioning(self, batch, device):
        length = self.planning_length(TEXT_WINDOW)
        width = self.parts["text_encoder"].config.hidden_size * LAYERS_PER_BUNDLE
        return {"hidden_states": torch.empty(batch, BUNDLES, length, width, dtype=self.compute_dtype("text_encoder"),
                                             device=device),
                # None: every token real (the transformer counts gist tokens from the mask's values)
                "attention_mask": None}

    # --- training ----------------------------------------------------------------------------

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow velocity (noise - clean) the transformer predicts for (B, C, H, W) latents at `sigmas`."""
        dtype = self.compute_dtype("transformer")
        mask = text["attention_mask"]
        return self.transformer(
            hidden_states=noisy.to(dtype), timestep=sigmas.to(noisy.device, dtype),
            encoder_hidden_states=text["hidden_states"].to(noisy.device, dtype),
            encoder_attention_mask=None if mask is None else mask.to(noisy.device).bool(), return_dict=False,
        )[0]

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import BriaFibo2Pipeline, FlowMatchEulerDiscreteScheduler

        # the embeddings come from the family (encoded as training encodes), so the pipeline's processor is
        # never called; its text encoder is the live language model (what load_lora_weights sees)
        pipe = BriaFibo2Pipeline(transformer=self.transformer, vae=self.parts["vae"],
                                 text_encoder=self.parts["text_encoder"], processor=None,
                                 scheduler=FlowMatchEulerDiscreteScheduler.from_config(self.noise_scheduler.config))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _prompt_embeds(self, prompt: str, device, negative: bool = False) -> torch.Tensor:
        """One prompt's bundles as training encodes them, cut to its real tokens (what the pipeline's
        encode_prompt gives a single prompt: no padding, no mask). The pipeline cleans the prompt's JSON
        caption, not the negative prompt's."""
        prompt = self.written_out_prompt(prompt)  # an embedding's placeholder written out, as captions are
        tokens = self._tokenize_as_given([prompt]) if negative else self.tokenize([prompt])
        text = self.encode_text(tokens)
        length = int(text["attention_mask"][0].sum())
        return text["hidden_states"][:, :, :length].to(device, self.sampling_dtype("transformer"))

    def run_sampling_pipeline(self, prompt, device):
        negative = {}
        if prompt.cfg > 1:  # the pipeline's second pass, on its trained null caption unless the prompt names one
            text = prompt.negative_prompt or _pipeline_facts().DEFAULT_NEGATIVE_PROMPT
            negative = {"negative_prompt_embeds": self._prompt_embeds(text, device, negative=True)}
        return self.pipeline()(
            prompt_embeds=self._prompt_embeds(prompt.prompt, device), guidance_scale=prompt.cfg,
            num_inference_steps=prompt.steps, width=prompt.width, height=prompt.height,
            generator=make_generator(device, prompt.seed), **negative,
        ).images[0]

    # --- adapters: what other tools do with the files (the key layout itself: keys/fibo2.py) -----

    def diffusers_skips_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        if part == "text_encoder":
            return ("BriaFibo2Pipeline.load_lora_weights loads the transformer's adapters only "
                    "(model.parts.text_encoder.train)")
        return None
