"""Wan 2.2 A14B adapter keys: each expert is a Wan transformer (modules/model/keys/wan.py). In a
backup the high-noise expert's adapters are `lora_unet_<original Wan name>` and the low-noise
expert's `lora_unet2_<original Wan name>`; saved files hold one expert each, written as a lone Wan
transformer (Wan22Family.adapter_files), so ComfyUI, musubi-tuner and diffusers read them as Wan
LoRAs. Only the high-noise expert has file layouts of its own here: the low-noise expert's
adapters are written through them."""

from __future__ import annotations

from modules.model.keys.wan import WAN_KEYS, wan_original_module_name
from modules.model.keys.layout import KeyLayout

WAN22_KEYS = KeyLayout(
    kohya_names={"transformer": wan_original_module_name, "transformer_2": wan_original_module_name},
    comfy=WAN_KEYS.comfy,
    comfy_text_encoder_prefixes=WAN_KEYS.comfy_text_encoder_prefixes,
    comfyui_skips=WAN_KEYS.comfyui_skips,
)
