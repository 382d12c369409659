"""Stable Diffusion 1.x adapter keys.

- kohya: `lora_unet_<diffusers module>`, `lora_te_text_model_...`.
- ComfyUI ("comfy"): `diffusion_model.<ldm module>` (ComfyUI keeps the original UNet names). Text
  encoders keep the kohya names (lora_te_...): ComfyUI maps them, and Forge, which does not match
  ComfyUI's own `text_encoders.clip_l.` paths, skips a whole file past 12 unmatched keys; those
  paths are still read when loading.
- diffusers: `unet.<module>`, `text_encoder.text_model...`.
"""

from __future__ import annotations

from modules.model.components.ldm_unet_keys import COMFYUI_UNET_ATTENTION_SKIP, ldm_unet_module_name
from modules.model.keys.layout import KOHYA_STEMS, ComfyStems, KeyLayout

# kohya's sd-scripts (networks/lora.py, kohya-ss/sd-scripts of 2026-02-16) builds its LoRA modules only
# inside the UNet's Transformer2DModel, ResnetBlock2D, Downsample2D and Upsample2D and the text
# encoder's CLIPAttention and CLIPMLP, and loads a file non-strictly: what lies outside is ignored
SD_SCRIPTS_UNET_SKIP = (r"^(conv_in|conv_out|time_embedding\.|add_embedding\.)",
                        "its LoRA network has no module outside the UNet's transformer, resnet and "
                        "up/down-sample blocks (conv_in, conv_out, the time and label embeddings)")
SD_SCRIPTS_CLIP_SKIP = (r"^(?!(text_model\.)?encoder\.layers\.\d+\.(self_attn|mlp)\.)",
                        "its LoRA network has no module outside the text encoder's attention and MLP layers")

SD15_KEYS = KeyLayout(
    text_model_parts=("text_encoder",),
    comfy={"unet": ComfyStems("diffusion_model.", ldm_unet_module_name), "text_encoder": KOHYA_STEMS},
    comfyui_skips={"unet": COMFYUI_UNET_ATTENTION_SKIP},
    sd_scripts_skips={"unet": SD_SCRIPTS_UNET_SKIP, "text_encoder": SD_SCRIPTS_CLIP_SKIP},
    other_stem_prefixes={"text_encoder": "text_encoders.clip_l.transformer."},
    diffusers_refuses={"comfy": "load_lora_weights refuses ComfyUI's ldm-named layout (\"Invalid LoRA "
                                "checkpoint\", diffusers 0.42); use 'kohya' for ComfyUI, Forge and diffusers alike"},
)
