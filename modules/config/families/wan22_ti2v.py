"""The Wan 2.2 TI2V 5B family (text- and image-to-video in one dense 5B model), as the config and
the GUI see it (torch-free); its implementation: modules/model/wan22_ti2v.py."""

from __future__ import annotations

from modules.config.families.wan import DECLARATION as WAN
from modules.config.family_declaration import FamilyDeclaration

DECLARATION = FamilyDeclaration(
    name="wan22_ti2v",
    label="Wan 2.2 TI2V 5B",
    part_specs=WAN.part_specs,  # UMT5, the 5B WanTransformer3DModel, the Wan 2.2 VAE: the same parts
    bucket_quantum=32,  # the Wan 2.2 VAE's 16x times the transformer's 2x2 patches
    layer_presets=WAN.layer_presets,
    denoiser_part="transformer",
    flow_matching=True,
    # a sample prompt's image, if it has one, starts the video (image-to-video); training conditions
    # on each clip's own first frame, so concepts take no paired control images
    prompt_control_images=(0, 1),
    image_to_video=True,  # model.image_to_video
    implementation="modules.model.wan22_ti2v:Wan22TI2VFamily",
)
