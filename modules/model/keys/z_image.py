"""Z-Image adapter keys: kohya `lora_unet_<diffusers module>` (what diffusers' Z-Image loader and
musubi-style trainers use) and `lora_te_<module>` for the Qwen3 encoder (prefixes: the family's
PartSpecs); diffusers `transformer.<module>`, `text_encoder.<module>`. No ComfyUI layout declared
yet (its files fuse q/k/v)."""

from __future__ import annotations

from modules.model.keys.layout import KeyLayout

Z_IMAGE_KEYS = KeyLayout()
