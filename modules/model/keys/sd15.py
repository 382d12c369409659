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

SD15_KEYS = KeyLayout(
    text_model_parts=("text_encoder",),
    comfy={"unet": ComfyStems("diffusion_model.", ldm_unet_module_name), "text_encoder": KOHYA_STEMS},
    comfyui_skips={"unet": COMFYUI_UNET_ATTENTION_SKIP},
    other_stem_prefixes={"text_encoder": "text_encoders.clip_l.transformer."},
)
