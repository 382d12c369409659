"""Anima (CircleStone Labs / Comfy Org, a ~2B anime model on NVIDIA's Cosmos-Predict2 2B DiT): a
Qwen3 0.6B text encoder, the LLM adapter (diffusers' AnimaTextConditioner: learned T5-token queries
cross-attending to the Qwen3 states), CosmosTransformer3DModel and the Qwen-Image/Wan 2.1 VAE
(AutoencoderKLQwenImage). Every fact below is diffusers 0.42's AnimaModularPipeline's
(modular_pipelines/anima/), reproduced so training sees what sampling sees:

- prompt: the raw caption (no template) through the Qwen tokenizer, Qwen3's last hidden states;
  the same caption through the T5 tokenizer gives the adapter's query ids; the
  adapter (masks of both) maps them to the transformer's text embeddings, zeroed past the T5
  tokens and zero-padded to its `min_sequence_length` (512 as released). Captions are padded here
  to a fixed window (the pipeline pads to the longest): Qwen3 is causal and right-padded and both
  masks hide the padding, so the real tokens' embeddings are the same (tests/test_family_anima.py);
  an empty caption gives an all-masked Qwen3 source either way. The adapter runs in encode_text, so
  its output is what the text cache holds; training the adapter (or Qwen3) runs it every step.
  An embedding trains into Qwen3's table; on the T5 side each of its tokens is the T5 pad id, as
  ComfyUI reads an embedding for Anima (`t5_tokens`; the pipeline's text step takes the same ids).
- latents: the VAE's mode of (B, 3, 1, H, W) frames, normalised per channel by `latents_mean` /
  `latents_std`, as Qwen-Image's; the transformer takes (B, C, 1, h, w) and a zero padding mask.
- rectified flow: the transformer takes sigma itself (the pipeline passes t / 1000) and predicts
  noise - latents (the scheduler's Euler step reads it as that velocity); the pipeline's sigmas
  linspace(1, 1/N, N) are shifted by the scheduler config's fixed `shift`, and training's sigmas by
  the same (flow_matching.py).
- sampling: AnimaModularPipeline (AnimaAutoBlocks) on the live modules, its ClassifierFreeGuidance
  at the prompt's cfg against the negative prompt (empty if none).

diffusers' CosmosTransformer3DModel resizes the padding mask with torchvision, which is not
installed here: components/cosmos_padding_mask.py. Adapter key names: modules/model/keys/anima.py.
Single files: ComfyUI's anima-*.safetensors (the DiT and the LLM adapter; single_file_part).
"""

from __future__ import annotations

import re

import torch

from modules.config.families.anima import DECLARATION
from modules.model.base import ModelFamily
from modules.model.components.cosmos_padding_mask import ensure_padding_mask_resize
from modules.model.components.flow_matching import FlowMatchingTraining
from modules.model.keys.anima import ANIMA_KEYS
from modules.model.qwen_image import latent_normalisation
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator

# AnimaTextEncoderStep's default `max_sequence_length` (both tokenizers)
MAX_TEXT_TOKENS = 512


# how ComfyUI's and the original Anima files hold the DiT and the LLM adapter: bare, or under one of these
_FILE_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "net.")
# the Cosmos-Predict2 DiT's top-level names in those files (diffusers' converter drops the bookkeeping ones)
_DIT_NAMES = ("blocks.", "x_embedder.", "t_embedder.", "t_embedding_norm.", "final_layer.", "pos_embedder.",
              "extra_pos_embedder.", "accum_")


def _bare(key: str) -> str:
    return next((key.removeprefix(p) for p in _FILE_PREFIXES if key.startswith(p)), key)


def _text_encoder_key(key: str) -> str:
    # a Qwen3ForCausalLM export keeps its `model.` level; the encoder is the Qwen3Model inside
    return key.removeprefix("model.")


def _text_encoder_step(family: AnimaFamily):
    """AnimaTextEncoderStep with the family's T5 ids (an embedding's tokens as T5 pad ids, as training
    reads them); its Qwen3 states are the step's own."""
    from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep

    class FamilyT5Ids(AnimaTextEncoderStep):
        @staticmethod
        def _get_t5_prompt_ids(components, prompt, max_sequence_length, device):
            ids, mask = family.t5_tokens([prompt] if isinstance(prompt, str) else prompt, max_sequence_length,
                                         "longest")
            return ids.to(device), mask.to(device)

    return FamilyT5Ids()


def _pipeline_on_the_transformers_device(blocks):
    """AnimaModularPipeline whose execution device is where the transformer computes. Its own is its
    first component's, the Qwen3 encoder's first parameter: its token table, which a frozen encoder
    keeps on the host (modules/offload/host_tables.py), so the T5 ids went to the CPU while the LLM
    adapter waited on the train device."""
    from diffusers import AnimaModularPipeline

    class OnTheTransformersDevice(AnimaModularPipeline):
        @property
        def _execution_device(self):
            return compute_device(self.transformer)

    return OnTheTransformersDevice(blocks=blocks)


def _quiet(blocks) -> None:
    """No progress bar from any block of a modular pipeline (the denoise loop sits three levels down)."""
    for block in getattr(blocks, "sub_blocks", {}).values():
        if hasattr(block, "set_progress_bar_config"):
            block.set_progress_bar_config(disable=True)
        _quiet(block)


class AnimaFamily(FlowMatchingTraining, ModelFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/
    # a modular pipeline: its folder's modular_model_index.json names this class (detect.py reads it)
    pipeline_classes = ("AnimaModularPipeline",)
    kohya_base_version = "anima"
    modelspec_architecture = "anima/lora"
    key_layout = ANIMA_KEYS
    # Anima (resources/model_configs/anima): Cosmos-Predict2 2B (28 blocks at 2048 wide), Qwen3 0.6B, the
    # 6-layer LLM adapter, the Qwen-Image (Wan 2.1) VAE
    nominal_part_parameters = {"text_encoder": 596_049_920, "text_conditioner": 134_663_680,
                               "transformer": 1_956_405_248, "vae": 126_892_531}
    text_parts = ("text_encoder", "text_conditioner")
    # textual inversion into Qwen3 0.6B's token table, under ComfyUI's Anima key (comfy/text_encoders/anima.py)
    embedding_slots = {"text_encoder": ("tokenizer", "qwen3_06b")}
    image_parts = ("vae",)
    # ComfyUI's anima-*.safetensors (the DiT with its llm_adapter); a Cosmos-Predict2 file has no llm_adapter
    single_file_signature = (r"^(model\.diffusion_model\.|diffusion_model\.|net\.)?llm_adapter\.", None)

    def load(self) -> None:
        from diffusers import AnimaTextConditioner, AutoencoderKLQwenImage, CosmosTransformer3DModel
        from transformers import AutoTokenizer, Qwen3Model

        ensure_padding_mask_resize()
        self.parts["text_encoder"] = self.load_part("text_encoder", Qwen3Model, rename=_text_encoder_key,
                                                    ignore_unexpected=[r"^lm_head\."])
        self.parts["text_conditioner"] = self.load_part("text_conditioner", AnimaTextConditioner)
        self.parts["transformer"] = self.load_part("transformer", CosmosTransformer3DModel)
        self.parts["vae"] = self.load_part("vae", AutoencoderKLQwenImage)
        self.load_flow_scheduler()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.support_folder("tokenizer")), local_files_only=True)
        self.t5_tokenizer = AutoTokenizer.from_pretrained(str(self.support_folder("t5_tokenizer")),
                                                          local_files_only=True)

    def single_file_part(self, part: str):
        """ComfyUI's Anima file holds the transformer (Cosmos-Predict2's names: diffusers' Cosmos converter) and
        the LLM adapter (`llm_adapter.`, AnimaTextConditioner's own names); Qwen3 and the VAE ship apart."""
        from diffusers.loaders import single_file_utils as convert

        from modules.loading.single_file import SingleFilePart

        prefixes = ("", *_FILE_PREFIXES)
        if part == "transformer":
            return SingleFilePart(tuple(p + name for p in prefixes for name in _DIT_NAMES),
                                  lambda sd, model: convert.convert_cosmos_transformer_checkpoint_to_diffusers(
                                      {_bare(k): v for k, v in sd.items()}))
        if part == "text_conditioner":
            return SingleFilePart(tuple(p + "llm_adapter." for p in prefixes),
                                  lambda sd, model: {_bare(k).removeprefix("llm_adapter."): v for k, v in sd.items()})
        return None

    @property
    def transformer(self):
        return self.parts["transformer"]

    @property
    def max_sequence_length(self) -> int:
        """The caption window of both tokenizers (the pipeline's 512, or less where a tokenizer allows less)."""
        return min(self.tokenizer.model_max_length, self.t5_tokenizer.model_max_length, MAX_TEXT_TOKENS)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "transformer":
            return list(self.transformer.transformer_blocks)
        if part == "text_conditioner":
            return list(self.parts[part].blocks)
        if part == "text_encoder":
            return list(self.parts[part].layers)
        return []

    # --- data --------------------------------------------------------------------------------

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        vae = self.parts["vae"]
        latents = vae.encode(pixels.to(self.compute_dtype("vae")).unsqueeze(2)).latent_dist.mode()  # one frame
        mean, std = latent_normalisation(vae, latents)
        return ((latents - mean) / std).squeeze(2)

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        length = self.max_sequence_length
        qwen = self.tokenizer(captions, padding="max_length", max_length=length, truncation=True,
                              padding_side="right", return_tensors="pt")
        t5_ids, t5_mask = self.t5_tokens(captions, length, "max_length")
        return {"input_ids": qwen.input_ids, "attention_mask": qwen.attention_mask,
                "t5_input_ids": t5_ids, "t5_attention_mask": t5_mask}

    def _embedding_tokens(self) -> list[str]:
        """The tokens the embeddings gave the Qwen tokenizer (each placeholder written out), longest first."""
        placeholders = [embedding.placeholder for embedding in self.config.embeddings]
        tokens = [token for token in self.tokenizer.get_added_vocab()
                  if any(token == p or re.fullmatch(re.escape(p) + r"_\d+", token) for p in placeholders)]
        return sorted(tokens, key=len, reverse=True)

    def t5_tokens(self, captions: list[str], length: int, padding: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, mask) of the captions through the T5 tokenizer: the LLM adapter's queries. An embedding's
        token is one T5 pad id, as ComfyUI's Anima encoder reads it (its T5 tokenizer gives the embedding's
        vectors, which AnimaTEModel replaces by the pad id); the text between is tokenized piece by piece,
        as ComfyUI splits a prompt at an embedding. Without embedding tokens: the tokenizer on the caption,
        as the pipeline."""
        tokenizer = self.t5_tokenizer
        tokens = self._embedding_tokens()
        if not any(token in caption for caption in captions for token in tokens):
            t5 = tokenizer(captions, padding=padding, max_length=length, truncation=True, return_tensors="pt")
            return t5.input_ids, t5.attention_mask
        pieces = re.compile(f"({'|'.join(map(re.escape, tokens))})")
        rows = []
        for caption in captions:
            ids = []
            for index, piece in enumerate(pieces.split(caption)):
                if index % 2:  # an embedding token
                    ids.append(tokenizer.pad_token_id)
                elif piece.strip():
                    ids += tokenizer(piece.strip(), add_special_tokens=False).input_ids
            rows.append(ids[:length - 1] + [tokenizer.eos_token_id])  # truncated as the tokenizer truncates
        width = length if padding == "max_length" else max(len(row) for row in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, row_ids in enumerate(rows):
            ids[row, :len(row_ids)], mask[row, :len(row_ids)] = torch.tensor(row_ids), 1
        return ids, mask

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoder, conditioner = self.parts["text_encoder"], self.parts["text_conditioner"]
        mask = tokens["attention_mask"].to(compute_device(encoder))
        # (AnimaTextEncoderStep also zeroes the padding's states; the adapter's source mask hides them either way)
        hidden = encoder(input_ids=tokens["input_ids"].to(compute_device(encoder)), attention_mask=mask,
                         use_cache=False).last_hidden_state  # no KV cache: a checkpointed layer recomputes
        device = compute_device(conditioner)
        embeds = conditioner(source_hidden_states=hidden.to(device, self.compute_dtype("text_conditioner")),
                             target_input_ids=tokens["t5_input_ids"].to(device),
                             target_attention_mask=tokens["t5_attention_mask"].to(device),
                             source_attention_mask=mask.to(device))
        return {"prompt_embeds": embeds}

    def planning_tokens(self, batch, device):
        # both tokenizers pad to the same window: Qwen3's ids and the adapter's T5 query ids
        length = self.planning_length(MAX_TEXT_TOKENS)
        ones = torch.ones(batch, length, dtype=torch.long, device=device)
        return {"input_ids": self.planning_ids(batch, length, device), "attention_mask": ones,
                "t5_input_ids": self.planning_ids(batch, length, device), "t5_attention_mask": ones.clone()}

    def planning_conditioning(self, batch, device):
        conditioner = self.parts["text_conditioner"].config
        length = max(self.planning_length(MAX_TEXT_TOKENS), conditioner.min_sequence_length)
        return {"prompt_embeds": torch.empty(batch, length, conditioner.target_dim,
                                             dtype=self.compute_dtype("text_conditioner"), device=device)}

    # --- training ----------------------------------------------------------------------------

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's velocity prediction (noise - latents) for (B, C, H, W) latents at `sigmas`."""
        dtype = self.compute_dtype("transformer")
        padding_mask = noisy.new_zeros(1, 1, *noisy.shape[-2:], dtype=dtype)  # the pipeline's: no padding
        out = self.transformer(hidden_states=noisy.to(dtype).unsqueeze(2), timestep=sigmas.to(dtype),
                               encoder_hidden_states=text["prompt_embeds"].to(dtype), padding_mask=padding_mask,
                               return_dict=False)[0]
        return out.squeeze(2)

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self, guidance_scale: float = 4.0):
        """AnimaModularPipeline (AnimaAutoBlocks) on the live modules."""
        from diffusers import AnimaAutoBlocks, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler

        blocks = AnimaAutoBlocks()
        blocks.sub_blocks["text_encoder"] = _text_encoder_step(self)
        _quiet(blocks)  # (the pipeline's set_progress_bar_config reaches its direct sub-blocks only)
        pipe = _pipeline_on_the_transformers_device(blocks)
        pipe.update_components(
            text_encoder=self.parts["text_encoder"], tokenizer=self.tokenizer, t5_tokenizer=self.t5_tokenizer,
            text_conditioner=self.parts["text_conditioner"], transformer=self.transformer, vae=self.parts["vae"],
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(self.noise_scheduler.config),
            guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
        return pipe

    def run_sampling_pipeline(self, prompt, device):
        return self.pipeline(prompt.cfg)(
            prompt=self.written_out_prompt(prompt.prompt), negative_prompt=self.written_out_prompt(prompt.negative_prompt),
            num_inference_steps=prompt.steps, width=prompt.width, height=prompt.height,
            generator=make_generator(device, prompt.seed), max_sequence_length=self.max_sequence_length,
            output_type="pil").images[0]

    # --- adapters: what other tools do with the files (the key layout itself: keys/anima.py) ---

    def diffusers_skips_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        if part == "text_encoder":
            return ("AnimaModularPipeline.load_lora_weights loads the transformer's and the LLM adapter's adapters "
                    "only (model.parts.text_encoder.train)")
        if fmt == "kohya":
            return ("its Anima loader reads only ComfyUI's `diffusion_model.` keys and its own; a kohya file's "
                    "`lora_unet_` keys load nothing (output.format 'diffusers')")
        return None
