"""The Wan 2.1 family, as the config and the GUI see it (torch-free); its implementation:
modules/model/wan.py."""

from __future__ import annotations

from modules.config.family_declaration import FamilyDeclaration, PartSpec

_DIT_ATTN = r"^transformer\.blocks\..*\.attn[12]\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj)$"
_DIT_MLP = r"^transformer\.blocks\..*\.ffn\.net\.(0\.proj|2)$"
_TE_ATTN = r"^text_encoder\..*\.SelfAttention\.(q|k|v|o)$"
_TE_MLP = r"^text_encoder\..*\.DenseReluDense\.(wi_0|wi_1|wo)$"

DECLARATION = FamilyDeclaration(
    name="wan",
    label="Wan 2.1",
    part_specs=(
        PartSpec("text_encoder", "text_encoder", "lora_te"),
        PartSpec("transformer", "transformer", "lora_unet", default_train=True),
        PartSpec("vae", "vae", None),
    ),
    bucket_quantum=16,  # the VAE's 8x times the transformer's 2x2 patches
    layer_presets={
        "attn": ([_DIT_ATTN, _TE_ATTN], False),
        "attn-mlp": ([_DIT_ATTN, _DIT_MLP, _TE_ATTN, _TE_MLP], False),
        "all-linear": ([r"^(transformer|text_encoder)\."], False),
        "all": ([r"^(transformer|text_encoder)\."], True),
    },
    denoiser_part="transformer",
    flow_matching=True,
    implementation="modules.model.wan:WanFamily",
)
