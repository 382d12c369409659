"""Bria FIBO Edit (briaai/Fibo-Edit-1.5-base and its turbo checkpoint), as diffusers'
BriaFiboEditPipeline (diffusers 0.42, pipelines/bria_fibo/pipeline_bria_fibo_edit.py) edits
reference images by an instruction:

- caption: FIBO Edit's structured edit JSON (`{"edit_instruction": ..., ...}`) as given, as the
  pipeline hands a string prompt to its tokenizer (the edit pipeline, unlike FIBO-2's, neither
  cleans nor reserializes it). The pipeline takes nothing else (`is_valid_edit_json`), so any other
  caption, a plain instruction ("make the jacket red"), is put in that form: the object
  {"edit_instruction": text}, serialized as the pipeline serializes a dict prompt (`edit_caption`);
  sample prompts go through the same. An empty caption is SmolLM3's begin-of-text token alone (token
  128000), as the pipeline encodes its empty negative prompt.
- text: SmolLM3 (SmolLM3ForCausalLM's language model, its head never run) on the caption; the
  transformer's joint text is its last two hidden states side by side (`get_prompt_embeds`), and each of its blocks
  also reads one hidden state through its own caption projection: the deepest ones, one per block,
  the last repeated where the blocks outnumber them (the pipeline's "remove first layers" /
  "duplicate last layer"). Kept: only the hidden states some block reads. Captions are padded on
  the right to a fixed window (`TEXT_WINDOW` tokens, so they batch and cache) with a mask of the real
  tokens, handed to every attention as the pipeline hands its CFG padding mask, so padding changes
  nothing (tests/test_family_fibo_edit.py).
- latents: the Wan 2.2 VAE's (AutoencoderKLWan) mean of a one-frame video, normalised per channel by
  the config's `latents_mean` / `latents_std` (`prepare_reference_latents`); tokens are the latent
  cells (the pipeline's default `do_patching=False`), or 2x2 patches where the transformer takes four
  times the VAE's channels.
- references (control images, `control_images` in the declaration): each control's latents, encoded
  as the target's, packed the same way and appended after the target's tokens, on RoPE time plane
  1, 2, ... (the target on plane 0), as `prepare_reference_latents` places them; the output is cut
  back to the target's tokens, so the loss is on the target alone and the references only condition.
- rectified flow: noisy = (1 - s) x + s noise; the transformer takes the timestep s * 1000 (the
  scheduler's timesteps) and predicts noise - x. Training draws logit-normal times shifted as the
  model's FlowMatchEulerDiscreteScheduler config shifts its sampling (`calculate_shift` on the
  image's token count, as the pipeline computes mu), or by loss.flow_shift.
- sampling: the pipeline itself (it encodes the prompt with the live SmolLM3, its
  head left out as in training, and its adapters, within the same window), CFG as it does it when cfg > 1 (a second pass on the
  negative prompt, by default the empty one; the negative prompt is not put in edit form, as the
  pipeline takes it as given).
  `sampling.prompts[].control_images` are resized to cover the sample's size and centre-cropped, as
  training brings each control to its target's bucket, and go to the pipeline's `image=`.

Not done here: the pipeline's `mask` (a grey-pasted inpainting region of the single reference).
Adapter key names: modules/model/keys/fibo_edit.py (diffusers' names: ComfyUI has no FIBO model).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Collection

import torch

from modules.config.families.fibo_edit import DECLARATION
from modules.model.base import ModelFamily
from modules.model.components.flow_matching import FlowMatchingTraining
from modules.model.keys.fibo_edit import FIBO_EDIT_KEYS
from modules.sampling.control_images import fitted_control_images
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator

# the tokens of a caption kept (the pipeline reads up to 3000)
TEXT_WINDOW = 2048
VAE_SCALE = 16  # BriaFiboEditPipeline.vae_scale_factor: pixels per latent cell
BEGIN_OF_TEXT = 128000  # what the pipeline encodes an empty prompt as (get_prompt_embeds' bot_token_id)


def _pipeline_class():
    from diffusers import BriaFiboEditPipeline

    return BriaFiboEditPipeline


class _NoLogits(torch.nn.Module):
    """Stands in for SmolLM3's head while the pipeline encodes: it reads only the hidden states,
    so no logits are computed (the head's weight is the token table, which may stay on the host)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[..., :0]


@contextlib.contextmanager
def _head_left_out(encoder):
    """The encoder's `lm_head` (never_run) swapped out for the call, put back after."""
    head = encoder.lm_head
    encoder.lm_head = _NoLogits()
    try:
        yield
    finally:
        encoder.lm_head = head


def edit_caption(text: str) -> str:
    """A caption as FIBO Edit reads it: edit JSON (or nothing) as given; other text as the edit
    instruction of an object, serialized as BriaFiboEditPipeline.__call__ serializes a dict prompt."""
    from diffusers.pipelines.bria_fibo.pipeline_bria_fibo_edit import is_valid_edit_json

    if text == "" or is_valid_edit_json(text):
        return text
    return json.dumps({"edit_instruction": text})


def read_layers(hidden_states: int, blocks: int) -> list[int]:
    """The hidden-state index each transformer block reads, as BriaFiboEditPipeline.__call__ fits
    `prompt_layers` to the blocks: the deepest `blocks` of them, or all with the last repeated."""
    if hidden_states >= blocks:
        return list(range(hidden_states - blocks, hidden_states))
    return list(range(hidden_states)) + [hidden_states - 1] * (blocks - hidden_states)


class FiboEditFamily(FlowMatchingTraining, ModelFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/
    pipeline_classes = ("BriaFiboEditPipeline",)
    denoiser_config = {"_class_name": "BriaFiboTransformer2DModel"}
    kohya_base_version = "fibo_edit"
    batched_guidance_above = 1.0  # its pipeline's cfg batch: torch.cat([latents] * 2) above guidance 1
    modelspec_architecture = "bria-fibo-edit/lora"
    key_layout = FIBO_EDIT_KEYS
    # FIBO's 8.3 B transformer (3072 wide, 8 joint and 38 single blocks, a caption projection per
    # block), SmolLM3-3B (embeddings tied to its head), the Wan 2.2 VAE
    nominal_part_parameters = {"text_encoder": 3_075_098_624, "transformer": 8_285_836_848, "vae": 704_688_668}
    text_parts = ("text_encoder",)
    # textual inversion into SmolLM3's token table (tied to its head, which is never run); ComfyUI has no
    # FIBO and no SmolLM3 key: named as its keys name an encoder (model and size, as qwen3_4b)
    embedding_slots = {"text_encoder": ("tokenizer", "smollm3_3b")}
    # SmolLM3's head (its weight is the token table) never runs: the text is the language model's
    # hidden states (encode_text and the sampling pipeline run `.model`), so the table can stay on the host
    never_run = {"text_encoder": ("lm_head",)}
    image_parts = ("vae",)
    # (layers, 2048, width) per caption, masked: the text cache keeps its real tokens (tests/test_family_fibo_edit.py:
    # the padded window predicts as the unpadded prompt; tests/test_text_padding.py: the cache holds only them)
    masked_text_padding = {"hidden_states": ("attention_mask", 1)}

    def load(self) -> None:
        from diffusers import AutoencoderKLWan, BriaFiboTransformer2DModel
        from transformers import AutoTokenizer, SmolLM3ForCausalLM

        self.parts["text_encoder"] = self.load_part("text_encoder", SmolLM3ForCausalLM)
        self.parts["transformer"] = self.load_part("transformer", BriaFiboTransformer2DModel)
        self.parts["vae"] = self.load_part("vae", AutoencoderKLWan)
        self.load_flow_scheduler()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.support_folder("tokenizer")), local_files_only=True)

    @property
    def transformer(self):
        return self.parts["transformer"]

    @property
    def max_sequence_length(self) -> int:
        return min(self.tokenizer.model_max_length, TEXT_WINDOW)

    @property
    def _blocks(self) -> int:
        config = self.transformer.config
        return config.num_layers + config.num_single_layers

    @property
    def _hidden_states(self) -> int:
        return self.parts["text_encoder"].config.num_hidden_layers + 1

    @property
    def _kept_layers(self) -> list[int]:
        """The hidden states kept per caption: every one a block reads, and the last two (the joint text)."""
        count = self._hidden_states
        return sorted(set(read_layers(count, self._blocks)) | {count - 2, count - 1})

    @property
    def patching(self) -> bool:
        """Whether tokens are 2x2 patches of latent cells (a transformer taking 4x the VAE's channels)."""
        return self.transformer.config.in_channels == 4 * self.parts["vae"].config.z_dim

    def caption_windows(self) -> list[tuple[object, int]]:
        return [(self.tokenizer, self.max_sequence_length)]

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "transformer":  # in the order forward() runs them
            return [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]
        if part == "text_encoder":
            return list(self.parts[part].model.layers)
        return []

    def unreachable_prefixes(self, part: str, names: Collection[str] | None = None) -> tuple[str, ...]:
        # the language-model head's logits are never read (nor computed)
        return ("lm_head",) if part == "text_encoder" else ()

    def latent_geometry(self) -> tuple[int, int]:
        config = json.loads((self.part_folder("vae") / "config.json").read_text(encoding="utf-8"))
        return config.get("z_dim", 16), VAE_SCALE

    # --- data --------------------------------------------------------------------------------

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> (B, C, H/16, W/16) latents normalised as prepare_reference_latents does."""
        vae = self.parts["vae"]
        latents = vae.encode(pixels.to(self.compute_dtype("vae")).unsqueeze(2)).latent_dist.mean[:, :, 0]
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1).to(latents)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1).to(latents)
        return (latents - mean) / std

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        captions = [edit_caption(caption) for caption in captions]
        tokens = self.tokenizer(captions, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                                padding_side="right", add_special_tokens=True, return_tensors="pt")
        ids, mask = tokens.input_ids, tokens.attention_mask
        for row, caption in enumerate(captions):
            if caption == "":  # as the pipeline encodes an empty prompt: the begin-of-text token alone
                ids[row], mask[row] = self.tokenizer.pad_token_id, 0
                ids[row, 0], mask[row, 0] = BEGIN_OF_TEXT, 1
        return {"input_ids": ids, "attention_mask": mask}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoder = self.parts["text_encoder"]
        mask = tokens["attention_mask"].to(compute_device(encoder))
        # the language model without its head (never_run): the same hidden states, no logits
        hidden = encoder.model(input_ids=tokens["input_ids"].to(compute_device(encoder)), attention_mask=mask,
                               output_hidden_states=True, use_cache=False).hidden_states
        return {"hidden_states": torch.stack([hidden[i] for i in self._kept_layers], dim=1), "attention_mask": mask}

    def planning_tokens(self, batch, device):
        length = self.planning_length(TEXT_WINDOW)
        return {"input_ids": self.planning_ids(batch, length, device),
                "attention_mask": torch.ones(batch, length, dtype=torch.long, device=device)}

    def planning_conditioning(self, batch, device):
        length = self.planning_length(TEXT_WINDOW)
        width = self.parts["text_encoder"].config.hidden_size
        return {"hidden_states": torch.empty(batch, len(self._kept_layers), length, width,
                                             dtype=self.compute_dtype("text_encoder"), device=device),
                "attention_mask": None}  # None: every token real

    # --- training ----------------------------------------------------------------------------

    def sequence_length(self, latents: torch.Tensor) -> int:
        """The target's token count (the pipeline's seq_len for mu)."""
        scale = 2 if self.patching else 1
        return (latents.shape[-2] // scale) * (latents.shape[-1] // scale)

    def _packed(self, latents: torch.Tensor, plane: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C, h, w) latents -> their tokens and position ids on RoPE time plane `plane`."""
        pipe = _pipeline_class()
        batch, channels, height, width = latents.shape
        if self.patching:
            tokens = pipe._pack_latents(latents, batch, channels, height, width)
            height, width = height // 2, width // 2
        else:
            tokens = pipe._pack_latents_no_patch(latents, batch, channels, height, width)
        ids = pipe._prepare_latent_image_ids(batch, height, width, latents.device, dtype)
        ids[..., 0] = plane
        return tokens, ids

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow velocity (noise - clean) for (B, C, H, W) latents at `sigmas`; `text["control_latents"]`
        (B, N, C, h, w), when the samples have control images, joins the sequence after the target's tokens."""
        dtype = self.compute_dtype("transformer")
        device = noisy.device
        height, width = noisy.shape[-2:]
        target, target_ids = self._packed(noisy.to(dtype), 0, dtype)
        tokens, ids = [target], [target_ids]
        controls = text.get("control_latents")
        for index in range(0 if controls is None else controls.shape[1]):
            packed, control_ids = self._packed(controls[:, index].to(device, dtype), index + 1, dtype)
            tokens.append(packed)
            ids.append(control_ids)
        hidden = text["hidden_states"].to(device, dtype)
        kept = self._kept_layers
        layers = [hidden[:, kept.index(i)] for i in read_layers(self._hidden_states, self._blocks)]
        prompt = torch.cat([hidden[:, -1], hidden[:, -2]], dim=-1)  # hidden_states[-1], [-2]
        sequence = torch.cat(tokens, dim=1)
        attention = {}
        mask = text.get("attention_mask")
        if mask is not None:
            full = torch.cat([mask.to(device).bool(),
                              torch.ones(sequence.shape[:2], dtype=torch.bool, device=device)], dim=1)
            if not full.all():  # as the pipeline: a key-padding mask only where something is padded
                attention = {"attention_mask": full[:, None, None, :]}
        out = self.transformer(
            hidden_states=sequence, timestep=(sigmas * 1000).to(device, dtype), encoder_hidden_states=prompt,
            text_encoder_layers=layers, txt_ids=torch.zeros(prompt.shape[1], 3, device=device, dtype=dtype),
            img_ids=torch.cat(ids, dim=0), joint_attention_kwargs=attention, return_dict=False,
        )[0][:, :target.shape[1]]
        pipe = _pipeline_class()
        if self.patching:
            return pipe._unpack_latents(out, height, width, 1)
        return pipe._unpack_latents_no_patch(out, height, width, 1)

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        # the whole SmolLM3ForCausalLM, as the released pipeline holds it (so a LoRA file's
        # `text_encoder.model.layers...` keys load into it); sampling leaves its head out (below)
        pipe = _pipeline_class()(transformer=self.transformer, vae=self.parts["vae"],
                                 text_encoder=self.parts["text_encoder"], tokenizer=self.tokenizer,
                                 scheduler=FlowMatchEulerDiscreteScheduler.from_config(self.noise_scheduler.config))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def run_sampling_pipeline(self, prompt, device):
        references = {}
        if prompt.control_images:
            references = {"image": fitted_control_images(prompt.control_images, prompt.width, prompt.height,
                                                         self.control_images, self.label)}
        with _head_left_out(self.parts["text_encoder"]):
            return self._run_pipeline(prompt, device, references)

    def _run_pipeline(self, prompt, device, references):
        return self.pipeline()(
            # an embedding's placeholder written out as its tokens, as captions are (the pipeline does not)
            prompt=edit_caption(self.written_out_prompt(prompt.prompt)),
            negative_prompt=self.written_out_prompt(prompt.negative_prompt) or None,
            guidance_scale=prompt.cfg,
            num_inference_steps=prompt.steps, width=prompt.width, height=prompt.height,
            generator=make_generator(device, prompt.seed), max_sequence_length=self.max_sequence_length,
            do_patching=self.patching, **references,
        ).images[0]
