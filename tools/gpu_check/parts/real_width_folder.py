"""A tiny model folder (`launch.py make-tiny-model`) made real-width where the training step's memory
is decided: its denoiser becomes a real-width slice (SDXL's widths with fewer transformer layers;
FLUX.1's with 2 double and 4 single blocks), its VAE the released one (so 1024 px images give
full-size latents), its text encoders as wide as the denoiser's conditioning (their depth stays
tiny: with the text cached they are not in the step). Random weights built on the train device
from resources/model_configs, nothing downloaded, then saved in place of the tiny parts.

The dry size keeps the released layouts at tiny widths (the same code, on the CPU, in seconds).
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import torch

from tools.gpu_check.parts.real_width import TINY_FLUX, TINY_SDXL, released_config

# SDXL's third level holds 10 transformer layers per block (85% of the block bytes): 4 keep its
# structure at half the bytes to write and load (the check's time); widths are SDXL's own
SDXL_SLICE = {"transformer_layers_per_block": [1, 2, 4]}
FLUX_SLICE = {"num_layers": 2, "num_single_layers": 4}
TINY_VAE = {"block_out_channels": [32, 32, 32, 32]}  # the released 4 levels (8x smaller latents), narrow
T5_WINDOW = 512  # FLUX.1's text window (the tiny tokenizer's is 32)


def _save_diffusers(folder: Path, config: dict, device, dtype) -> None:
    import diffusers

    model_cls = getattr(diffusers, config["_class_name"])
    with torch.device(device):
        model = model_cls.from_config(config).to(dtype)
    _replace(folder, model)


def _save_transformers(folder: Path, device, dtype, **widths) -> None:
    """The folder's text encoder rebuilt with `widths` (config fields) and random weights."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(folder))
    for key, value in widths.items():
        if not hasattr(config, key):
            raise ValueError(f"{folder}/config.json: {type(config).__name__} has no {key!r} to set")
        setattr(config, key, value)
    with torch.device(device):
        model = getattr(transformers, config.architectures[0])(config).to(dtype)
    _replace(folder, model)


def _heads(width: int) -> int:
    """CLIP's heads at a width: 64 wide each, as in SDXL's and FLUX.1's encoders (one at tiny widths)."""
    return width // 64 or 1


def _replace(folder: Path, model) -> None:
    shutil.rmtree(folder)  # the tiny weights go (a sharded save would otherwise sit beside them)
    model.save_pretrained(str(folder))
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # nothing of the build stays allocated for the training's peak


def make_sdxl_real_width(folder: Path, device, dtype, dry: bool) -> dict:
    """The SDXL folder's UNet (slice), VAE and text encoders made real-width; the UNet's config."""
    unet = {**released_config("sdxl", "unet"), "_class_name": "UNet2DConditionModel", **SDXL_SLICE,
            **(TINY_SDXL if dry else {})}
    _save_diffusers(folder / "unet", unet, device, dtype)
    _save_diffusers(folder / "vae", {**released_config("sdxl", "vae"), "_class_name": "AutoencoderKL",
                                     **(TINY_VAE if dry else {})}, device, dtype)
    # the UNet reads both encoders' hidden states side by side and the second's projection pooled
    pooled = unet["projection_class_embeddings_input_dim"] - 6 * unet["addition_time_embed_dim"]
    first = unet["cross_attention_dim"] - pooled
    _save_transformers(folder / "text_encoder", device, dtype, hidden_size=first, num_attention_heads=_heads(first))
    _save_transformers(folder / "text_encoder_2", device, dtype, hidden_size=pooled, num_attention_heads=_heads(pooled),
                       projection_dim=pooled)
    return unet


def make_flux_real_width(folder: Path, device, dtype, dry: bool) -> dict:
    """The FLUX.1 folder's transformer (slice), VAE and text encoders made real-width; the
    transformer's config."""
    from modules.model.tiny.char_tokenizers import write_char_sentencepiece_tokenizer

    transformer = {**released_config("flux", "transformer"), "_class_name": "FluxTransformer2DModel",
                   **FLUX_SLICE, **(TINY_FLUX if dry else {})}
    _save_diffusers(folder / "transformer", transformer, device, dtype)
    _save_diffusers(folder / "vae", {**released_config("flux", "vae"), "_class_name": "AutoencoderKL",
                                     **(TINY_VAE if dry else {})}, device, dtype)
    # CLIP's pooled output is its hidden width; T5's hidden states, at its window, are the text tokens
    pooled = transformer["pooled_projection_dim"]
    _save_transformers(folder / "text_encoder", device, dtype, hidden_size=pooled, num_attention_heads=_heads(pooled))
    _save_transformers(folder / "text_encoder_2", device, dtype, d_model=transformer["joint_attention_dim"])
    if not dry:
        shutil.rmtree(folder / "tokenizer_2")
        write_char_sentencepiece_tokenizer(folder / "tokenizer_2", max_length=T5_WINDOW)
    return transformer


MAKERS = {"sdxl": make_sdxl_real_width, "flux": make_flux_real_width}
