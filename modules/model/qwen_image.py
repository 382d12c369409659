"""Qwen-Image (Qwen/Qwen-Image): a 20B double-stream MMDiT (QwenImageTransformer2DModel, 60 blocks),
the Qwen2.5-VL-7B language model as text encoder, and the Wan-style AutoencoderKLQwenImage (16
latent channels, one frame). Every fact below is QwenImagePipeline's (diffusers 0.42,
pipelines/qwenimage/pipeline_qwenimage.py), reproduced so training sees what sampling sees:

- prompt: the caption in the pipeline's chat template (a system line asking to describe the image,
  the caption as the user turn, the assistant header); the language model's last hidden states
  (after its final norm) of the real tokens, less the template's first 34 tokens (the system line
  and the user header, `prompt_template_encode_start_idx`), moved to the front and zero-padded,
  with a 0/1 mask of the kept tokens. The language model is causal and the tokenizer pads on the
  right, so truncating the tokens before encoding keeps the kept tokens' states (the pipeline
  truncates after encoding).
- the transformer attends only to the masked-in text tokens (`encoder_hidden_states_mask`, a bool
  key mask): a caption padded further predicts the same (tests/test_family_qwen_image.py). The
  text RoPE starts after the image's (scale_rope) extent, so it too is padding-independent.
- latents: the VAE's mean on (B, 3, 1, H, W) frames, normalised per channel by the config's
  `latents_mean` / `latents_std` ((z - mean) / std; the pipeline decodes z * std + mean); packed as
  FLUX's 2x2 patches; `img_shapes` = (1, H/2, W/2) per sample.
- rectified flow: the transformer takes sigma itself (the pipeline passes timestep / 1000) and
  predicts noise - latents; sigmas shifted exponentially by the image's sequence length as the
  scheduler config's dynamic shift (mu from base/max_image_seq_len 256/8192, shift 0.5/0.9).
- sampling: the family's own embeddings handed to the pipeline; "true" CFG (`true_cfg_scale` =
  the prompt's cfg, a negative prompt, empty if none, and the pipeline's norm rescale) when cfg > 1.

Only the language model of Qwen2.5-VL is loaded (Qwen2_5_VLTextModel, 7.07B of the checkpoint's
8.29B): the vision tower and lm_head never touch a text prompt. Adapter key names:
modules/model/keys/qwen_image.py.
"""

from __future__ import annotations

from typing import Collection

import torch

from modules.config.families.qwen_image import DECLARATION
from modules.loading.diffusers_folder import ModelLoadError
from modules.model.base import ModelFamily, numbered_blocks
from modules.model.components.flow_matching import FlowMatchingTraining
from modules.model.flux import pack_latents, unpack_latents
from modules.model.keys.qwen_image import QWEN_IMAGE_KEYS
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator

# QwenImagePipeline.prompt_template_encode and prompt_template_encode_start_idx
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TEMPLATE_TOKENS_DROPPED = 34
# the pipeline's default `max_sequence_length`: text tokens kept after the drop
MAX_TEXT_TOKENS = 512


def _text_encoder_key(key: str) -> str:
    # Qwen2_5_VLForConditionalGeneration files keep the language model under `model.` (transformers 4)
    # or `model.language_model.` (transformers 5); the vision tower (`visual.`) and lm_head are ignored
    for prefix in ("model.language_model.", "model."):
        if key.startswith(prefix):
            return key.removeprefix(prefix)
    return key


def latent_normalisation(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the VAE's latents per channel, shaped (1, C, 1, 1, 1) like `like`."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    std = torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, std


class QwenImageFamily(FlowMatchingTraining, ModelFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/
    pipeline_classes = ("QwenImagePipeline",)
    denoiser_config = {"_class_name": "QwenImageTransformer2DModel"}
    # ComfyUI's qwen_image_*.safetensors: the diffusers names, bare or under model.diffusion_model.;
    # Qwen-Image 2.1 (another architecture) has a `txt_in.text_norm`
    single_file_signature = (r"^(model\.diffusion_model\.)?transformer_blocks\.\d+\.img_mod\.1\.",
                             r"txt_in\.text_norm\.")
    kohya_base_version = "qwen_image"
    modelspec_architecture = "qwen-image/lora"
    key_layout = QWEN_IMAGE_KEYS
    # Qwen-Image: 60 blocks at 3072 wide; Qwen2.5-VL-7B's language model; the Wan-2.1-style VAE
    nominal_part_parameters = {"text_encoder": 7_070_619_136, "transformer": 20_430_401_088, "vae": 126_892_531}
    text_parts = ("text_encoder",)
    image_parts = ("vae",)
    # (512, 3584) per caption, the real tokens first and zeros after (encode_text): the text cache keeps
    # the real ones and the batch re-pads with zeros, the same tensors (tests/test_text_padding.py); the
    # edit families' captions, control image tokens included, the same way
    masked_text_padding = {"hidden_states": ("attention_mask", 0)}
    # ComfyUI's Qwen-Image embedding key (comfy/text_encoders/qwen_image.py: Qwen25_7BVLITokenizer's
    # embedding_key 'qwen25_7b', 3584 wide)
    embedding_slots = {"text_encoder": ("tokenizer", "qwen25_7b")}

    def load(self) -> None:
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import AutoTokenizer, Qwen2_5_VLTextModel

        self.parts["text_encoder"] = self.load_part(
            "text_encoder", Qwen2_5_VLTextModel, rename=_text_encoder_key,
            ignore_unexpected=[r"^visual\.", r"^lm_head\."])
        self.parts["transformer"] = self.load_part("transformer", QwenImageTransformer2DModel)
        self.parts["vae"] = self.load_part("vae", AutoencoderKLQwenImage)
        self.load_flow_scheduler()
        folder = self.support_folder("tokenizer")
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self._check_template_split(folder)

    def _check_template_split(self, folder) -> None:
        # the 34 dropped tokens are the template's system line and user header as Qwen2.5's tokenizer
        # splits them; another tokenizer would drop part of the caption or keep part of the template
        prefix = PROMPT_TEMPLATE.split("{}")[0]
        count = len(self.tokenizer(prefix, add_special_tokens=False).input_ids)
        if count != TEMPLATE_TOKENS_DROPPED:
            raise ModelLoadError(
                f"model.base: the tokenizer in {folder} splits Qwen-Image's prompt template before the caption into "
                f"{count} tokens, where QwenImagePipeline drops {TEMPLATE_TOKENS_DROPPED}: not Qwen2.5-VL's tokenizer")

    def single_file_part(self, part: str):
        # ComfyUI's Qwen-Image transformer file has diffusers' own names (diffusers' single-file
        # mapping for QwenImageTransformer2DModel is the identity); the text encoder and VAE ship apart
        from modules.loading.single_file import SingleFilePart

        if part != "transformer":
            return None
        prefix = "model.diffusion_model."
        return SingleFilePart(
            (prefix, "transformer_blocks.", "img_in.", "txt_in.", "txt_norm.", "time_text_embed.", "norm_out.",
             "proj_out."),
            lambda sd, model: {k.removeprefix(prefix): v for k, v in sd.items()})

    @property
    def transformer(self):
        return self.parts["transformer"]

    @property
    def max_sequence_length(self) -> int:
        """Text tokens kept after the template's drop (the tokenizer may allow fewer)."""
        return min(self.tokenizer.model_max_length - TEMPLATE_TOKENS_DROPPED, MAX_TEXT_TOKENS)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "transformer":
            return list(self.transformer.transformer_blocks)
        if part == "text_encoder":
            return list(self.parts[part].layers)
        return []

    def unreachable_prefixes(self, part: str, names: Collection[str] | None = None) -> tuple[str, ...]:
        # the last block's text stream feeds nothing after it (only the image tokens reach proj_out):
        # its text queries, text attention output and text MLP never reach the loss
        if part != "transformer":
            return super().unreachable_prefixes(part, names)
        blocks, count = numbered_blocks(self._module_names(part, names), "transformer_blocks")
        if not count:
            return ()
        last = f"{blocks}.{count - 1}."
        return tuple(last + name for name in ("attn.add_q_proj", "attn.norm_added_q", "attn.to_add_out", "txt_mlp."))

    # --- data --------------------------------------------------------------------------------

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        vae = self.parts["vae"]
        latents = vae.encode(pixels.to(self.compute_dtype("vae")).unsqueeze(2)).latent_dist.mean  # one frame
        mean, std = latent_normalisation(vae, latents)
        return ((latents - mean) / std).squeeze(2)

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        tokens = self.tokenizer([PROMPT_TEMPLATE.format(c) for c in captions], padding="max_length",
                                max_length=TEMPLATE_TOKENS_DROPPED + self.max_sequence_length, truncation=True,
                                padding_side="right", return_tensors="pt")
        return {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoder = self.parts["text_encoder"]
        mask = tokens["attention_mask"].to(compute_device(encoder))
        # (no KV cache: a checkpointed layer recomputed in the backward would append to it a second time)
        hidden = encoder(input_ids=tokens["input_ids"].to(compute_device(encoder)), attention_mask=mask,
                         use_cache=False).last_hidden_state
        # as QwenImagePipeline._get_qwen_prompt_embeds: the real tokens past the template's first 34, at
        # the front, zero-padded (here to a fixed length, so captions batch and cache). tokenize pads on
        # the right to the drop plus max_sequence_length, so each caption's real tokens past the drop are
        # already at the front: a slice and the mask select them (no selection by value: the planner
        # runs this on tensors without data)
        kept_mask = mask[:, TEMPLATE_TOKENS_DROPPED:].contiguous()
        embeds = torch.where(kept_mask.bool().unsqueeze(-1), hidden[:, TEMPLATE_TOKENS_DROPPED:], 0)
        return {"hidden_states": embeds, "attention_mask": kept_mask}

    def planning_tokens(self, batch, device):
        length = TEMPLATE_TOKENS_DROPPED + self.planning_length(MAX_TEXT_TOKENS)
        return {"input_ids": self.planning_ids(batch, length, device),
                "attention_mask": torch.ones(batch, length, dtype=torch.long, device=device)}

    def planning_conditioning(self, batch, device):
        length = self.planning_length(MAX_TEXT_TOKENS)
        return {"hidden_states": torch.empty(batch, length, self.parts["text_encoder"].config.hidden_size,
                                             dtype=self.compute_dtype("text_encoder"), device=device),
                "attention_mask": torch.empty(batch, length, dtype=torch.long, device=device)}

    # --- training ----------------------------------------------------------------------------

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's velocity prediction (noise - latents) for (B, C, H, W) latents at `sigmas`."""
        dtype = self.compute_dtype("transformer")
        batch, _, height, width = noisy.shape
        out = self.transformer(
            hidden_states=pack_latents(noisy).to(dtype), timestep=sigmas.to(dtype),
            encoder_hidden_states=text["hidden_states"].to(dtype),
            encoder_hidden_states_mask=text["attention_mask"].to(noisy.device).bool(),
            img_shapes=[(1, height // 2, width // 2)] * batch, return_dict=False,
        )[0]
        return unpack_latents(out, height, width)

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

        pipe = QwenImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(self.noise_scheduler.config),
            vae=self.parts["vae"], text_encoder=self.parts["text_encoder"], tokenizer=self.tokenizer,
            transformer=self.transformer,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _prompt_conditioning(self, prompt: str, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings, mask) as training computes them, on the sampling device in the transformer's
        dtype (the pipeline draws its latents in the embeddings' dtype)."""
        text = self.encode_text(self.tokenize([self.written_out_prompt(prompt)]))  # placeholders written out
        return (text["hidden_states"].to(device, self.sampling_dtype("transformer")),
                text["attention_mask"].to(device))

    def run_sampling_pipeline(self, prompt, device):
        embeds, mask = self._prompt_conditioning(prompt.prompt, device)
        negative = {}
        if prompt.cfg > 1:  # true CFG needs a negative prompt; an empty one is the usual default
            embeds_n, mask_n = self._prompt_conditioning(prompt.negative_prompt or "", device)
            negative = {"negative_prompt_embeds": embeds_n, "negative_prompt_embeds_mask": mask_n}
        return self.pipeline()(
            prompt_embeds=embeds, prompt_embeds_mask=mask, true_cfg_scale=prompt.cfg,
            num_inference_steps=prompt.steps, width=prompt.width, height=prompt.height,
            generator=make_generator(device, prompt.seed), max_sequence_length=self.max_sequence_length, **negative,
        ).images[0]

    # --- adapters: what other tools do with the files (the key layout itself: keys/qwen_image.py) ---

    def diffusers_skips_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        if part == "text_encoder":
            return ("QwenImagePipeline.load_lora_weights loads the transformer's adapters only "
                    "(model.parts.text_encoder.train)")
        return None
