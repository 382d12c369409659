"""The Stable Diffusion XL family, as the config and the GUI see it (torch-free); its implementation:
modules/model/sdxl.py."""

from __future__ import annotations

from modules.config.family_declaration import FamilyDeclaration, PartSpec

_UNET_ATTN = r"^unet\..*\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$"
_UNET_FF = r"^unet\..*\.ff\.net\.(0\.proj|2)$"
_TE_ATTN = r"^text_encoder(_2)?\..*\.self_attn\.(q_proj|k_proj|v_proj|out_proj)$"
_TE_MLP = r"^text_encoder(_2)?\..*\.mlp\.(fc1|fc2)$"

DECLARATION = FamilyDeclaration(
    name="sdxl",
    label="Stable Diffusion XL",
    part_specs=(
        PartSpec("text_encoder", "text_encoder", "lora_te1"),
        PartSpec("text_encoder_2", "text_encoder_2", "lora_te2"),
        PartSpec("unet", "unet", "lora_unet", default_train=True),
        PartSpec("vae", "vae", None),
    ),
    bucket_quantum=64,
    layer_presets={
        "attn": ([_UNET_ATTN, _TE_ATTN], False),
        "attn-mlp": ([_UNET_ATTN, _UNET_FF, _TE_ATTN, _TE_MLP], False),
        "all-linear": ([r"^(unet|text_encoder|text_encoder_2)\."], False),
        "all": ([r"^(unet|text_encoder|text_encoder_2)\."], True),
    },
    denoiser_part="unet",
    implementation="modules.model.sdxl:SDXLFamily",
)
