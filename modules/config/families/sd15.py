"""The Stable Diffusion 1.5 family, as the config and the GUI see it (torch-free); its implementation:
modules/model/sd15.py."""

from __future__ import annotations

from modules.config.family_declaration import FamilyDeclaration, PartSpec

_UNET_ATTN = r"^unet\..*\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$"
_UNET_FF = r"^unet\..*\.ff\.net\.(0\.proj|2)$"
_TE_ATTN = r"^text_encoder\..*\.self_attn\.(q_proj|k_proj|v_proj|out_proj)$"
_TE_MLP = r"^text_encoder\..*\.mlp\.(fc1|fc2)$"

DECLARATION = FamilyDeclaration(
    name="sd15",
    label="Stable Diffusion 1.5",
    part_specs=(
        PartSpec("text_encoder", "text_encoder", "lora_te"),
        PartSpec("unet", "unet", "lora_unet", default_train=True),
        PartSpec("vae", "vae", None),
    ),
    bucket_quantum=64,
    layer_presets={
        "attn": ([_UNET_ATTN, _TE_ATTN], False),
        "attn-mlp": ([_UNET_ATTN, _UNET_FF, _TE_ATTN, _TE_MLP], False),
        "all-linear": ([r"^(unet|text_encoder)\."], False),
        "all": ([r"^(unet|text_encoder)\."], True),
    },
    denoiser_part="unet",
    implementation="modules.model.sd15:SD15Family",
)
