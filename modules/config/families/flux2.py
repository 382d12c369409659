"""The FLUX.2 family, as the config and the GUI see it (torch-free); its implementation:
modules/model/flux2.py."""

from __future__ import annotations

from modules.config.family_declaration import FamilyDeclaration, PartSpec

_DIT_ATTN = (r"^transformer\.transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|"
             r"add_v_proj|to_add_out)$",
             r"^transformer\.single_transformer_blocks\.\d+\.attn\.to_qkv_mlp_proj$")
_DIT_MLP = (r"^transformer\.transformer_blocks\.\d+\.(ff|ff_context)\.(linear_in|linear_out)$",
            r"^transformer\.single_transformer_blocks\.\d+\.attn\.to_out$")
_TE_ATTN = r"^text_encoder\..*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)$"
_TE_MLP = r"^text_encoder\..*\.mlp\.(gate_proj|up_proj|down_proj)$"

DECLARATION = FamilyDeclaration(
    name="flux2",
    label="FLUX.2",
    part_specs=(
        PartSpec("text_encoder", "text_encoder", "lora_te"),
        PartSpec("transformer", "transformer", "lora_unet", default_train=True),
        PartSpec("vae", "vae", None),
    ),
    bucket_quantum=64,
    layer_presets={
        "attn": ([*_DIT_ATTN, _TE_ATTN], False),
        "attn-mlp": ([*_DIT_ATTN, *_DIT_MLP, _TE_ATTN, _TE_MLP], False),
        "all-linear": ([r"^(transformer|text_encoder)\."], False),
        "all": ([r"^(transformer|text_encoder)\."], True),
    },
    denoiser_part="transformer",
    flow_matching=True,
    # reference images (multi-reference editing, as Flux2KleinPipeline / Flux2Pipeline take `image=`):
    # optional per concept; this bound keeps a sample's sequence at most 5x the target's
    control_images=4,
    planned_control_images=0,  # a text-to-image run unless its concepts carry references
    implementation="modules.model.flux2:Flux2Family",
)
