"""Wan 2.1 image-to-video 14B, as the config and the GUI see it (torch-free); its implementation:
modules/model/wan_i2v.py."""

from __future__ import annotations

from dataclasses import replace

from modules.config.family_declaration import PartSpec
from modules.config.families.wan import DECLARATION as WAN

DECLARATION = replace(
    WAN,
    name="wan_i2v",
    label="Wan 2.1 I2V 14B",
    part_specs=(
        PartSpec("text_encoder", "text_encoder", "lora_te"),
        # CLIP ViT-H/14's vision tower: frozen, never adapted (no key prefix), but a part so weight
        # modes, the cache's fingerprint and the planner see it
        PartSpec("image_encoder", "image_encoder", None),
        PartSpec("transformer", "transformer", "lora_unet", default_train=True),
        PartSpec("vae", "vae", None),
    ),
    # every sample starts from one prompt image (sampling.prompts[].control_images[0]); Wan 2.1 FLF2V's
    # ends on a second, its last frame (the variant, told by its transformer: modules/model/wan_i2v.py).
    # Training conditions on each clip's own first (and last) frame, so concepts take no paired controls
    prompt_control_images=(1, 2),
    implementation="modules.model.wan_i2v:WanI2VFamily",
)
