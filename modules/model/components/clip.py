"""CLIP text encoders as SD1.x, SDXL and FLUX use them: loading a diffusers `text_encoder/`
folder of any transformers version, tokenizing to the tokenizer's fixed length, and the original
(ldm) single-file layout. transformers is imported inside the functions (validation reads family
files and should not pay for it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from modules.model.base import ModelFamily

# transformers 5 dropped CLIPTextModel's `text_model.` level (not CLIPTextModelWithProjection's);
# kohya, ComfyUI and diffusers files keep it (lora_te_text_model_encoder_layers_0_...)
TEXT_MODEL_LEVEL = "text_model."


def clip_text_encoder_key(key: str) -> str:
    # transformers 5 dropped CLIPTextModel's `text_model.` level; older exports keep it
    return key.removeprefix(TEXT_MODEL_LEVEL)


def load_clip_text_encoder(family: ModelFamily, part: str) -> torch.nn.Module:
    """A CLIPTextModel (CLIP-L) part, from an export with or without the `text_model.` level."""
    from transformers import CLIPTextModel

    return family.load_part(part, CLIPTextModel, rename=clip_text_encoder_key,
                            ignore_unexpected=[r"^embeddings\.position_ids$"])


def load_clip_text_encoder_with_projection(family: ModelFamily, part: str) -> torch.nn.Module:
    """A CLIPTextModelWithProjection (OpenCLIP-G in SDXL): hidden states and a pooled projection."""
    from transformers import CLIPTextModelWithProjection

    return family.load_part(part, CLIPTextModelWithProjection,
                            ignore_unexpected=[r"^text_model\.embeddings\.position_ids$"])


def load_clip_tokenizer(family: ModelFamily, folder: str = "tokenizer"):
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(str(family.support_folder(folder)), local_files_only=True)


def clip_input_ids(tokenizer, captions: list[str]) -> torch.Tensor:
    """Token ids padded and truncated to the tokenizer's fixed length (77 for the released models)."""
    return tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids


def clip_encoder_layers(encoder: torch.nn.Module) -> list[torch.nn.Module]:
    """The encoder's transformer layers in order: the units checkpointing recomputes."""
    inner = getattr(encoder, "text_model", encoder)  # CLIPTextModelWithProjection keeps the level
    return list(inner.encoder.layers)


def ldm_clip_single_file(prefix: str, remove_prefix: str | None = None):
    """A CLIP-L text encoder stored under `prefix` in an original-layout checkpoint."""
    from diffusers.loaders import single_file_utils as convert

    from modules.loading.single_file import SingleFilePart

    if remove_prefix is None:
        return SingleFilePart((prefix,), lambda sd, model: convert.convert_ldm_clip_checkpoint(sd))
    return SingleFilePart((prefix,), lambda sd, model: convert.convert_ldm_clip_checkpoint(sd, remove_prefix=remove_prefix))


def clip_window(tokenizer, encoder: torch.nn.Module) -> int:
    """CLIP's token window: the tokenizer's, or (planning without one) the encoder's position count
    (77 in the released models)."""
    return tokenizer.model_max_length if tokenizer is not None else encoder.config.max_position_embeddings
