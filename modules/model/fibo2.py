"""Bria FIBO-2 (briaai/Fibo-2.0-dev and its turbo checkpoint), as diffusers' BriaFibo2Pipeline
(diffusers 0.42, pipelines/bria_fibo2/pipeline_bria_fibo2.py) generates an image from a caption:

- caption: the text as given (a .txt that may hold FIBO's structured JSON caption). A caption that
  parses as a JSON object is put in the form FIBO-2 was trained on, as the pipeline's __call__ does
  (`_parse_prompt`: empty values and the aesthetic/preference scores dropped, then serialized
  compactly); any other text is encoded as it is. No text is turned into JSON here.
- text: the caption in the pipeline's chat turn (`PROMPT_TEMPLATE`), through Qwen3-VL (its vision
  tower and language model, no lm_head); 18 of its hidden states, each scaled to unit RMS per token
  in float32, concatenated three at a time into six bundles (`TEXT_ENCODER_OUT_LAYERS`: the
  Perceiver's, then one per injection block), (B, 6, L, 3 x width), as `_get_qwen_prompt_embeds`
  computes them. Captions are padded on the right to a fixed window (`TEXT_WINDOW` tokens, so they
  batch and cache) with a mask of the real tokens: the transformer counts a prompt's gist tokens from
  the mask and masks the padding out of every attention, so padding changes nothing
  (tests/test_family_fibo2.py). Layers from the 36th on are never read, nor is the vision tower
  trained (no adapters there: unreachable_prefixes).
- images Qwen3-VL sees (`<|vision_start|><|image_pad|><|vision_end|>` in the prompt, the pad token
  repeated once per merged 2x2 patch, as Qwen3VLProcessor expands it; done here with the tokenizer
  and Qwen2VLImageProcessorPil, as that processor needs torchvision), in this order:
  - editing (control images, one per sample: `control_images` in the declaration): the prompt is
    the pipeline's edit prompt (`_get_edit_prompt`: `{"image": marker, "structured_caption": ...,
    "edit_instruction": ...}`; a caption that is not such JSON is the instruction alone), the
    control shown at its target's bucket, at most 768 pixels a side (`text_encoder_image_size`), as
    the pipeline's image processor crops it to the result's size and thumbnails Qwen3-VL's copy.
    Its latents (encoded as the target's) go to the transformer as `context_latents`: clean tokens
    on the next RoPE plane, which the transformer leaves out of its output itself.
  - `text_render`: a JSON caption's `text_render` entries with text are each drawn as the pipeline
    draws them (text_images.draw_text_image, Pillow's built-in font, the pipeline's default `fonts`),
    their markers put in the entries (`_mark_text_images`). A generation shows them to Qwen3-VL only
    at noise levels at or below 0.9 (`text_images_max_noise_level`) and encodes the caption with the
    markers left empty above: encode_text gives both (`base_hidden_states`, `base_attention_mask`:
    all masked for a caption without text to render) and denoise picks per sample by its sigma. An
    edit shows them at every step (no base encoding).
  Because the conditioning of a pair depends on its control, it is cached per (caption, control,
  bucket, mirrored or not) and a trained text encoder, embeddings or varying captions with paired
  data are refused (modules/data/pairs.py, check_control_text), as for Qwen-Image-Edit.
- latents: AutoencoderKLFlux2's mode, 2x2-patchified, normalised by the VAE's batch-norm statistics,
  and unpatchified back to (B, 32, H/8, W/8) (`prepare_image_latents`); the transformer patchifies
  them itself.
- rectified flow: noisy = (1 - s) x + s noise; the transformer takes the noise level s in [0, 1]
  (the pipeline passes t / 1000) and predicts noise - x (the scheduler's Euler step adds
  (s_next - s) times it). Training draws logit-normal times shifted as the model's
  FlowMatchEulerDiscreteScheduler config shifts its sampling schedule (by the image's token count
  where it shifts dynamically, `calculate_shift` as the pipeline computes mu), or by loss.flow_shift.
- sampling: the pipeline's loop (its noise draw, shifted sigmas, Euler steps, CFG and decode) run
  here on embeddings encoded as training encodes them (the live encoder and its adapters), because
  the pipeline switches to the images of a caption's text only for prompts it encodes itself (which
  needs Qwen3VLProcessor, hence torchvision). CFG when the prompt's cfg > 1: a second pass on the
  negative prompt, by default the null caption FIBO-2 was trained with (`DEFAULT_NEGATIVE_PROMPT`),
  without images; `sampling.prompts[].control_images[0]` is the image to edit, cropped to the
  sample's size by the pipeline's image processor and conditioning both passes.

Not done here: the pipeline's `mask` (a region of the image to edit greyed out), several images to
edit at once (the pipeline takes up to 5), and the fonts the pipeline's `fonts` names for
characters outside Pillow's built-in font (Aileron, DejaVu Sans: drawn here as that font draws them).
Adapter key names: modules/model/keys/fibo2.py (diffusers' names: ComfyUI has no FIBO model).
"""

from __future__ import annotations

import json
from typing import Collection

import torch

from modules.config.families.fibo2 import DECLARATION
from modules.errors import UserError
from modules.model.base import ModelFamily, numbered_blocks
from modules.model.components.flow_matching import FlowMatchingTraining
from modules.model.keys.fibo2 import FIBO2_KEYS
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator, shape_only

# the tokens of a caption kept (the pipeline reads up to 4096; a prompt's gist-token count stops
# growing at the transformer's `gist_max_text_len`, 2048 as released)
TEXT_WINDOW = 2048
# the pipeline's bundles: 6 x 3 hidden states (kept here too where the planner reads them without diffusers)
BUNDLES, LAYERS_PER_BUNDLE = 6, 3
IMAGE_PAD = "<|image_pad|>"
# BriaFibo2Pipeline's instance settings (set in its __init__; tests/test_family_fibo2.py checks them): the
# largest side Qwen3-VL sees an image to edit at, and the noise level from which on a generation shows it
# the images of its caption's text
TEXT_ENCODER_IMAGE_SIZE = 768
TEXT_IMAGES_MAX_NOISE_LEVEL = 0.9


def _text_encoder_key(key: str) -> str:
    """A Qwen3VLForConditionalGeneration file's key as Qwen3VLModel names it: transformers-5 files keep
    `model.visual.` and `model.language_model.`, transformers-4 style files `visual.` and `model.`
    (the lm_head is ignored)."""
    if key.startswith(("model.visual.", "model.language_model.")):
        return key.removeprefix("model.")
    if key.startswith("model."):
        return "language_model." + key.removeprefix("model.")
    return key


def trained_caption(text: str) -> str:
    """A caption as BriaFibo2Pipeline.__call__ hands it to the text encoder: a JSON object cleaned and
    serialized compactly (`_parse_prompt`), any other text unchanged."""
    from diffusers import BriaFibo2Pipeline

    caption, _ = BriaFibo2Pipeline._parse_prompt(text)
    if isinstance(caption, str):
        return text
    return json.dumps(caption or {}, separators=(",", ":"), ensure_ascii=False)


def _compact(caption: dict) -> str:
    return json.dumps(caption, separators=(",", ":"), ensure_ascii=False)


def text_images(caption: dict | str | None) -> list:
    """The images of a parsed caption's text, as BriaFibo2Pipeline.__call__ draws them by default: one per
    `text_render` entry that has text, in order (none for a caption that is not a JSON object)."""
    from diffusers.pipelines.bria_fibo2.text_images import draw_text_image

    entries = (caption.get("text_render") or []) if isinstance(caption, dict) else []
    return [draw_text_image(entry["text"]) for entry in entries
            if isinstance(entry, dict) and isinstance(entry.get("text"), str) and entry["text"]]


def _check_edit_caption(caption: str) -> None:
    """An edit's caption is the instruction, or JSON with an "edit_instruction" key (and the result's
    caption): BriaFibo2Pipeline.check_inputs refuses other JSON objects, and so does training."""
    try:
        edit = json.loads(caption)
    except json.JSONDecodeError:
        return
    if isinstance(edit, dict) and "edit_instruction" not in edit:
        raise UserError(f"FIBO-2: an edit pair's caption that is a JSON object needs an \"edit_instruction\" key "
                        f"(the instruction; the result's caption beside it): {caption[:80]!r}")


def _pipeline_facts():
    from diffusers.pipelines.bria_fibo2 import pipeline_bria_fibo2

    return pipeline_bria_fibo2


class Fibo2Family(FlowMatchingTraining, ModelFamily):
    declaration = DECLARATION  # name, label, parts, layer presets, control images: modules/config/families/
    pipeline_classes = ("BriaFibo2Pipeline",)
    denoiser_config = {"_class_name": "BriaFibo2Transformer2DModel"}
    kohya_base_version = "fibo2"
    modelspec_architecture = "bria-fibo-2/lora"
    key_layout = FIBO2_KEYS
    # Fibo-2.0: the 8.1 B transformer (3584 wide, 44 blocks, 5 injection blocks, a 2-layer Perceiver),
    # Qwen3-VL-4B (its 0.42 B vision tower and 4.02 B language model, no lm_head), FLUX.2's 32-channel VAE
    nominal_part_parameters = {"text_encoder": 4_437_815_808, "transformer": 8_127_342_213, "vae": 84_046_115}
    text_parts = ("text_encoder",)
    # Qwen3-VL sees the image to edit (and the images of a caption's text, drawn from the caption itself)
    text_sees_controls = True
    # textual inversion into Qwen3-VL-4B's token table; ComfyUI has no FIBO: the key is the one its Krea 2
    # encoder reads for the same language model (comfy/text_encoders/krea2.py)
    embedding_slots = {"text_encoder": ("tokenizer", "qwen3vl_4b")}
    image_parts = ("vae",)
    # (6, L, 3 x width) per caption, and its encoding without the images of its text: the text cache keeps
    # their real tokens (tests/test_family_fibo2.py: padding changes nothing; tests/test_text_padding.py)
    masked_text_padding = {"hidden_states": ("attention_mask", 1), "base_hidden_states": ("base_attention_mask", 1)}

    def load(self) -> None:
        from diffusers import AutoencoderKLFlux2, BriaFibo2Transformer2DModel
        from transformers import AutoTokenizer, Qwen3VLModel
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.parts["text_encoder"] = self.load_part("text_encoder", Qwen3VLModel, rename=_text_encoder_key,
                                                    ignore_unexpected=[r"^lm_head\."])
        self.parts["transformer"] = self.load_part("transformer", BriaFibo2Transformer2DModel)
        self.parts["vae"] = self.load_part("vae", AutoencoderKLFlux2)
        self.load_flow_scheduler()
        # the released processor/ folder is Qwen3VLProcessor's: its tokenizer and its image processor's config
        folder = str(self.support_folder("processor"))
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder, local_files_only=True)

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
            return list(self.parts[part].language_model.layers)
        return []

    def zero_gated_prefixes(self, part: str) -> tuple[str, ...]:
        # an injection block adds cross_attn_gate.tanh() x its cross-attention: diffusers initializes the
        # gate at zero (the released weights have trained ones), which silences the cross-attention
        # and both its norms until the gate has moved
        if part != "transformer":
            return ()
        return tuple(f"layers.{i}.{name}" for i, block in enumerate(self.transformer.layers)
                     if getattr(block, "cross_attention", None) is not None and not block.cross_attn_gate.detach().any()
                     for name in ("cross_attention.", "cross_attn_norm1.", "cross_attn_norm2."))

    def unreachable_prefixes(self, part: str, names: Collection[str] | None = None) -> tuple[str, ...]:
        # hidden_states[k] is what layer k-1 outputs: layers from the deepest one read on never reach the loss;
        # the vision tower reaches it only for images (a caption without any would leave its adapters unlearned)
        if part != "text_encoder":
            return ()
        deepest = max(max(bundle) for bundle in self.out_layers)
        blocks, count = numbered_blocks(self._module_names(part, names), "layers")
        return ("visual.", *(f"{blocks}.{i}." for i in range(deepest, count)))

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

    def _prompts(self, caption: str, controls: list) -> tuple[str, list, str | None]:
        """A caption's prompt for Qwen3-VL, the images it marks (the image to edit, then those of its text),
        and, for a generation with images of its text, its prompt with their markers left empty."""
        from diffusers import BriaFibo2Pipeline

        facts = _pipeline_facts()
        if controls:  # an edit: the images of its text at every step
            _check_edit_caption(caption)
            drawn = text_images(BriaFibo2Pipeline._parse_prompt(caption)[0])
            return BriaFibo2Pipeline._get_edit_prompt(caption, len(controls), text_images=bool(drawn)), \
                [*controls, *drawn], None
        prompt = trained_caption(caption)
        drawn = text_images(BriaFibo2Pipeline._parse_prompt(prompt)[0])
        if not drawn:
            return prompt, [], None
        return (_compact(BriaFibo2Pipeline._mark_text_images(json.loads(prompt), facts.VISION_MARKER)), drawn,
                _compact(BriaFibo2Pipeline._mark_text_images(json.loads(prompt), "")))

    def tokenize(self, captions: list[str], controls: list[list] | None = None) -> dict[str, torch.Tensor]:
        """Token ids of each caption in the pipeline's chat turn with the images it shows Qwen3-VL (each
        caption's control images, PIL, at its bucket: `controls`), their pixel patches and grids, and the
        ids of each caption without the images of its text (all masked where it has none)."""
        controls = controls or [[] for _ in captions]
        prompts, images, bases = [], [], []
        for caption, own in zip(captions, controls):
            copies = []
            for image in own:  # Qwen3-VL's copy of the image to edit: at most 768 pixels a side
                copy = image.convert("RGB")
                copy.thumbnail((TEXT_ENCODER_IMAGE_SIZE, TEXT_ENCODER_IMAGE_SIZE))
                copies.append(copy)
            prompt, marked, base = self._prompts(caption, copies)
            prompts.append(prompt)
            images += marked
            bases.append(base)
        tokens = {}
        if images:
            processed = self.image_processor(images=images, return_tensors="pt")
            merge = self.image_processor.merge_size ** 2
            counts = iter([int(grid.prod()) // merge for grid in processed["image_grid_thw"]])
            prompts = ["".join(piece if i == 0 else IMAGE_PAD * next(counts) + piece
                               for i, piece in enumerate(prompt.split(IMAGE_PAD))) for prompt in prompts]
            tokens = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
        tokens.update(self._tokenize_as_given(prompts, images=bool(images)))
        if images:  # Qwen3-VL's multimodal RoPE places the image tokens by this (what Qwen3VLProcessor returns)
            pad = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
            tokens["mm_token_type_ids"] = (tokens["input_ids"] == pad).long()
        if any(base is not None for base in bases):
            base = self._tokenize_as_given(["" if b is None else b for b in bases])
            base["attention_mask"][[b is None for b in bases]] = 0  # masked: the caption's own encoding at every step
        else:
            base = {"input_ids": torch.zeros_like(tokens["input_ids"]),
                    "attention_mask": torch.zeros_like(tokens["attention_mask"])}
        tokens.update(base_input_ids=base["input_ids"], base_attention_mask=base["attention_mask"])
        return tokens

    def embedding_probe_captions(self, placeholder: str) -> list[str]:
        # a JSON caption is cleaned and reserialized (trained_caption): the placeholder in one of its values too
        return [placeholder, json.dumps({"short_description": f"a {placeholder} photo"})]

    def _tokenize_as_given(self, texts: list[str], images: bool = False) -> dict[str, torch.Tensor]:
        template = _pipeline_facts().PROMPT_TEMPLATE
        tokens = self.tokenizer([template.format(text) for text in texts], padding="max_length",
                                max_length=self.max_sequence_length, truncation=True, padding_side="right",
                                return_tensors="pt")
        if images:  # a truncated prompt would lose image tokens Qwen3-VL has features for
            pad = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
            for text, ids in zip(texts, tokens.input_ids):
                if int((ids == pad).sum()) != text.count(IMAGE_PAD):
                    raise UserError(f"{self.label}: a caption with its images is longer than the "
                                    f"{self.max_sequence_length} tokens read: {text[:80]!r}...")
        return {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}

    def _bundles(self, hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # as _get_qwen_prompt_embeds: each layer at unit RMS per token (in float32), three per bundle
        dtype = hidden[0].dtype
        normalized = {}
        for layer in sorted({layer for bundle in self.out_layers for layer in bundle}):
            states = hidden[layer].float()
            normalized[layer] = (states * torch.rsqrt(states.pow(2).mean(dim=-1, keepdim=True) + 1e-6)).to(dtype)
        return torch.stack([torch.cat([normalized[layer] for layer in bundle], dim=-1) for bundle in self.out_layers],
                           dim=1)

    def _encode(self, ids: torch.Tensor, mask: torch.Tensor, images: dict) -> torch.Tensor:
        encoder = self.parts["text_encoder"]
        hidden = encoder(input_ids=ids.to(compute_device(encoder)), attention_mask=mask, **images, output_hidden_states=True,
                         use_cache=False).hidden_states  # no KV cache: a checkpointed layer recomputes
        return self._bundles(hidden)

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoder = self.parts["text_encoder"]
        device = compute_device(encoder)
        mask = tokens["attention_mask"].to(device)
        images = {}
        if "pixel_values" in tokens:
            images = {"pixel_values": tokens["pixel_values"].to(device, self.compute_dtype("text_encoder")),
                      "image_grid_thw": tokens["image_grid_thw"].to(device),
                      "mm_token_type_ids": tokens["mm_token_type_ids"].to(device)}
        hidden = self._encode(tokens["input_ids"], mask, images)
        base_mask = tokens.get("base_attention_mask")
        if base_mask is None:  # ids made without one (the negative prompt): no text to render
            base_mask = torch.zeros_like(mask)
        base_mask = base_mask.to(device)
        rows = base_mask.any(dim=1)
        base = hidden.new_zeros(hidden.shape)
        # the planner's step reads no caption: it plans captions without images of their text (no second pass)
        if not shape_only(rows) and rows.any():  # the captions with images of their text, again without them
            base[rows] = self._encode(tokens["base_input_ids"][rows.cpu()], base_mask[rows], {})
        return {"hidden_states": hidden, "attention_mask": mask, "base_hidden_states": base,
                "base_attention_mask": base_mask}

    def planning_tokens(self, batch, device):
        length = self.planning_length(TEXT_WINDOW)
        return {"input_ids": self.planning_ids(batch, length, device),
                "attention_mask": torch.ones(batch, length, dtype=torch.long, device=device),
                # as tokenize gives a caption without images of its text: no second pass
                "base_input_ids": torch.zeros(batch, length, dtype=torch.long, device=device),
                "base_attention_mask": torch.zeros(batch, length, dtype=torch.long, device=device)}

    def planning_tokens_with_controls(self, batch, device, controls, width, height):
        # the image to edit sits inside the fixed window: the language model's pass is as long (the vision
        # tower's pass, whose activations no gradient keeps, is left out)
        return self.planning_tokens(batch, device)

    def planning_conditioning(self, batch, device):
        # an image's tokens sit inside the fixed window: the image to edit lengthens nothing here
        length = self.planning_length(TEXT_WINDOW)
        width = self.parts["text_encoder"].config.text_config.hidden_size * LAYERS_PER_BUNDLE
        dtype = self.compute_dtype("text_encoder")
        return {"hidden_states": torch.empty(batch, BUNDLES, length, width, dtype=dtype, device=device),
                # None: every token real (the transformer counts gist tokens from the mask's values)
                "attention_mask": None,
                # the encoding without the images of a caption's text, as long (all masked without any)
                "base_hidden_states": torch.empty(batch, BUNDLES, length, width, dtype=dtype, device=device),
                "base_attention_mask": None}

    # --- training ----------------------------------------------------------------------------

    def _conditioning_at(self, sigmas: torch.Tensor, text: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bundles and mask each sample reads at its noise level: above the pipeline's
        text_images_max_noise_level (0.9) a caption with images of its text reads its encoding without them."""
        hidden, mask, base_mask = text["hidden_states"], text["attention_mask"], text.get("base_attention_mask")
        if base_mask is None:
            return hidden, mask
        early = (sigmas.to(base_mask.device).float() > TEXT_IMAGES_MAX_NOISE_LEVEL) & base_mask.bool().any(dim=1)
        if not early.any():
            return hidden, mask
        hidden = torch.where(early.to(hidden.device)[:, None, None, None], text["base_hidden_states"].to(hidden), hidden)
        return hidden, torch.where(early[:, None], base_mask, mask.to(base_mask.device))

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow velocity (noise - clean) the transformer predicts for (B, C, H, W) latents at `sigmas`;
        `text["control_latents"]` (B, N, C, h, w), for pairs, are the images to edit (`context_latents`)."""
        dtype = self.compute_dtype("transformer")
        hidden, mask = self._conditioning_at(sigmas, text)
        controls = text.get("control_latents")
        context = None if controls is None else [controls[:, i].to(noisy.device, dtype) for i in range(controls.shape[1])]
        return self.transformer(
            hidden_states=noisy.to(dtype), timestep=sigmas.to(noisy.device, dtype),
            encoder_hidden_states=hidden.to(noisy.device, dtype),
            encoder_attention_mask=None if mask is None else mask.to(noisy.device).bool(), context_latents=context,
            return_dict=False,
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

    @torch.no_grad()
    def run_sampling_pipeline(self, prompt, device):
        """BriaFibo2Pipeline.__call__'s loop on the family's encodings: see the module's docstring."""
        import numpy as np
        from diffusers.pipelines.bria_fibo2.pipeline_bria_fibo2 import calculate_shift, retrieve_timesteps

        from modules.sampling.control_images import fitted_control_images

        pipe = self.pipeline()
        dtype = self.sampling_dtype("transformer")
        pixels, shown = None, None
        if prompt.control_images:  # the image to edit: the VAE's crop and Qwen3-VL's copy, as the pipeline makes them
            images = fitted_control_images(prompt.control_images, prompt.width, prompt.height, self.control_images,
                                           self.label)
            pixels, shown = pipe.image_processor.preprocess(images, height=prompt.height, width=prompt.width,
                                                            text_encoder_image_size=TEXT_ENCODER_IMAGE_SIZE)
        text = self.encode_text(self.tokenize([self.written_out_prompt(prompt.prompt)], [shown] if shown else None))

        def real_tokens(hidden, mask):  # what the pipeline's encode_prompt gives a single prompt: no padding
            return hidden[:, :, :int(mask[0].sum())].to(device, dtype)

        embeds = real_tokens(text["hidden_states"], text["attention_mask"])
        base = (real_tokens(text["base_hidden_states"], text["base_attention_mask"])
                if text["base_attention_mask"].any() else None)
        negative = None
        if prompt.cfg > 1:  # the pipeline's second pass, on its trained null caption unless the prompt names one
            negative = self._prompt_embeds(prompt.negative_prompt or _pipeline_facts().DEFAULT_NEGATIVE_PROMPT, device,
                                           negative=True)
        latents = pipe.prepare_latents(1, self.transformer.config.in_channels, prompt.height, prompt.width, device,
                                       make_generator(device, prompt.seed))
        context = None if pixels is None else pipe.prepare_image_latents(pixels, 1, device, dtype)
        patch = self.transformer.config.patch_size
        config = pipe.scheduler.config
        mu = calculate_shift((latents.shape[2] // patch) * (latents.shape[3] // patch), config.base_image_seq_len,
                             config.max_image_seq_len, config.base_shift, config.max_shift)
        timesteps, _ = retrieve_timesteps(pipe.scheduler, prompt.steps, device,
                                          sigmas=np.linspace(1.0, 1 / prompt.steps, prompt.steps), mu=mu)
        for t in timesteps:
            timestep = t.expand(1) / 1000
            # a caption with images of its text: without them while the noise level is above 0.9
            cond = embeds if base is None or float(t) / 1000 <= TEXT_IMAGES_MAX_NOISE_LEVEL else base
            velocity = self.transformer(hidden_states=latents.to(dtype), timestep=timestep, encoder_hidden_states=cond,
                                        context_latents=context, return_dict=False)[0].float()
            if negative is not None:
                uncond = self.transformer(hidden_states=latents.to(dtype), timestep=timestep,
                                          encoder_hidden_states=negative, context_latents=context,
                                          return_dict=False)[0].float()
                velocity = uncond + prompt.cfg * (velocity - uncond)
            latents = pipe.scheduler.step(velocity, t, latents, return_dict=False)[0]
        # undo the batch-norm normalisation, then decode (the pipeline's step 7)
        vae = self.parts["vae"]
        patches = pipe._patchify_latents(latents)
        scale = (1 / torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps)).view(1, -1, 1, 1).to(patches)
        patches = patches / scale + vae.bn.running_mean.view(1, -1, 1, 1).to(patches)
        image = vae.decode(pipe._unpatchify_latents(patches).to(vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")[0]

    # --- adapters: what other tools do with the files (the key layout itself: keys/fibo2.py) -----

    def diffusers_skips_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        if part == "text_encoder":
            return ("BriaFibo2Pipeline.load_lora_weights loads the transformer's adapters only "
                    "(model.parts.text_encoder.train)")
        return None
