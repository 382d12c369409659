"""The Qwen-Image-Edit-Plus family (Qwen/Qwen-Image-Edit-2509 and -2511: Qwen-Image-Edit taking
several control images, each shown to the VL text encoder as "Picture N"), as the config and the
GUI see it (torch-free); its implementation: modules/model/qwen_image_edit_plus.py."""

from __future__ import annotations

from dataclasses import replace

from modules.config.families.qwen_image_edit import DECLARATION as QWEN_IMAGE_EDIT

DECLARATION = replace(
    QWEN_IMAGE_EDIT,
    name="qwen_image_edit_plus",
    label="Qwen-Image-Edit-Plus (2509/2511)",
    # QwenImageEditPlusPipeline takes any number; Qwen's model cards name 1 to 3 as what it was trained on
    control_images=3,
    # its presets are planned for two references per sample (a subject and a garment, a person and a
    # scene: what the multi-image models are trained for), each a VL encoder's picture and latents
    planned_control_images=2,
    implementation="modules.model.qwen_image_edit_plus:QwenImageEditPlusFamily",
)
