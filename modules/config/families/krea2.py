"""The Krea-2 family, as the config and the GUI see it (torch-free); its implementation:
modules/model/krea2.py."""

from __future__ import annotations

from modules.config.family_declaration import FamilyDeclaration, PartSpec

# the transformer blocks' and the text-fusion blocks' attention (q, k, v, the sigmoid output gate, out)
_DIT_ATTN = r"^transformer\..*\.attn\.(to_q|to_k|to_v|to_gate|to_out\.0)$"
_DIT_MLP = r"^transformer\..*\.ff\.(gate|up|down)$"
_TE_ATTN = r"^text_encoder\..*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)$"
_TE_MLP = r"^text_encoder\..*\.mlp\.(gate_proj|up_proj|down_proj)$"

DECLARATION = FamilyDeclaration(
    name="krea2",
    label="Krea-2",
    part_specs=(
        PartSpec("text_encoder", "text_encoder", "lora_te"),
        PartSpec("transformer", "transformer", "lora_unet", default_train=True),
        PartSpec("vae", "vae", None),
    ),
    bucket_quantum=64,
    layer_presets={
        "attn": ([_DIT_ATTN, _TE_ATTN], False),
        "attn-mlp": ([_DIT_ATTN, _DIT_MLP, _TE_ATTN, _TE_MLP], False),
        "all-linear": ([r"^(transformer|text_encoder)\."], False),
        "all": ([r"^(transformer|text_encoder)\."], True),
    },
    denoiser_part="transformer",
    flow_matching=True,
    implementation="modules.model.krea2:Krea2Family",
)
