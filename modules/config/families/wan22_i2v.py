"""Wan 2.2 I2V A14B (image-to-video), as the config and the GUI see it (torch-free): Wan 2.2 A14B's
parts (UMT5, the high-noise `transformer` and low-noise `transformer_2` experts, the Wan 2.1 VAE),
no CLIP image encoder; every sample starts from one prompt image. Implementation:
modules/model/wan22_i2v.py."""

from __future__ import annotations

from dataclasses import replace

from modules.config.families.wan22 import DECLARATION as WAN22

DECLARATION = replace(
    WAN22,
    name="wan22_i2v",
    label="Wan 2.2 I2V A14B",
    # every sample starts from one prompt image (sampling.prompts[].control_images[0]); training
    # conditions on each clip's own first frame, so concepts take no paired control images
    prompt_control_images=(1, 1),
    implementation="modules.model.wan22_i2v:Wan22I2VFamily",
)
