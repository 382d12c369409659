"""Stable Diffusion XL adapter keys.

- kohya (sd-scripts' SDXL networks): `lora_unet_<ldm module>` (`lora_unet_input_blocks_4_1_...`),
  `lora_te1_text_model_...` (CLIP-L), `lora_te2_text_model_...` (CLIP-G).
- ComfyUI ("comfy"): `diffusion_model.<ldm module>`; the text encoders keep the kohya names,
  which ComfyUI and Forge both match (Forge does not match ComfyUI's `text_encoders.clip_l.`
  paths, which are still read when loading).
- diffusers: `unet.<module>`, `text_encoder.text_model...`, `text_encoder_2.text_model...`.
"""

from __future__ import annotations

from modules.model.components.ldm_unet_keys import COMFYUI_UNET_ATTENTION_SKIP, ldm_unet_module_name
from modules.model.keys.layout import KOHYA_STEMS, ComfyStems, KeyLayout
from modules.model.keys.sd15 import SD_SCRIPTS_CLIP_SKIP, SD_SCRIPTS_UNET_SKIP

# SDXL's extra UNet modules under their ldm names (the rest is shared with SD1.x: ldm_unet_keys.py)
_ADD_EMBEDDING = {"add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}


def sdxl_ldm_unet_module_name(unet, module_name: str) -> str:
    """The original (sgm) name of a diffusers SDXL UNet module."""
    for diffusers_name, ldm in _ADD_EMBEDDING.items():
        if module_name == diffusers_name or module_name.startswith(diffusers_name + "."):
            return ldm + module_name[len(diffusers_name):]
    return ldm_unet_module_name(unet, module_name)


SDXL_KEYS = KeyLayout(
    # CLIPTextModelWithProjection (CLIP-G) kept its `text_model.` level
    text_model_parts=("text_encoder",),
    kohya_names={"unet": sdxl_ldm_unet_module_name},
    comfy={"unet": ComfyStems("diffusion_model.", sdxl_ldm_unet_module_name),
           "text_encoder": KOHYA_STEMS, "text_encoder_2": KOHYA_STEMS},
    comfyui_skips={"unet": COMFYUI_UNET_ATTENTION_SKIP},
    sd_scripts_skips={"unet": SD_SCRIPTS_UNET_SKIP, "text_encoder": SD_SCRIPTS_CLIP_SKIP,
                      "text_encoder_2": SD_SCRIPTS_CLIP_SKIP},
    other_stem_prefixes={"text_encoder": "text_encoders.clip_l.transformer.",
                         "text_encoder_2": "text_encoders.clip_g.transformer."},
    diffusers_refuses={"comfy": "load_lora_weights refuses ComfyUI's ldm-named layout (\"Invalid LoRA "
                                "checkpoint\", diffusers 0.42); use 'kohya' for ComfyUI, Forge and diffusers alike"},
)
