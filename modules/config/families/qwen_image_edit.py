"""The Qwen-Image-Edit family (Qwen/Qwen-Image-Edit: Qwen-Image's transformer and VAE, its Qwen2.5-VL
text encoder reading the control image too), as the config and the GUI see it (torch-free); its
implementation: modules/model/qwen_image_edit.py."""

from __future__ import annotations

from dataclasses import replace

from modules.config.families.qwen_image import DECLARATION as QWEN_IMAGE
from modules.config.families.qwen_image import _DIT_ATTN, _DIT_MLP

# the text encoder's language model only: Qwen2.5-VL's vision tower has MLPs of the same names
_TE_ATTN = r"^text_encoder\.language_model\..*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)$"
_TE_MLP = r"^text_encoder\.language_model\..*\.mlp\.(gate_proj|up_proj|down_proj)$"

# Qwen-Image's parts and bucket size: the same transformer and VAE
DECLARATION = replace(
    QWEN_IMAGE,
    name="qwen_image_edit",
    label="Qwen-Image-Edit",
    layer_presets={
        "attn": ([_DIT_ATTN, _TE_ATTN], False),
        "attn-mlp": ([_DIT_ATTN, _DIT_MLP, _TE_ATTN, _TE_MLP], False),
        "all-linear": ([r"^transformer\.", r"^text_encoder\.language_model\."], False),
        "all": ([r"^transformer\.", r"^text_encoder\.language_model\."], True),
    },
    control_images=1,  # QwenImageEditPipeline conditions on one image
    planned_control_images=1,  # an edit pair: a preset is planned with its control (Edit-Plus too)
    implementation="modules.model.qwen_image_edit:QwenImageEditFamily",
)
