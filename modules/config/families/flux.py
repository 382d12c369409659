"""The FLUX.1 family, as the config and the GUI see it (torch-free); its implementation:
modules/model/flux.py."""

from __future__ import annotations

from modules.config.family_declaration import FamilyDeclaration, PartSpec

_DIT_ATTN = r"^transformer\..*\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$"
_DIT_MLP = (r"^transformer\.transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)$",
            r"^transformer\.single_transformer_blocks\.\d+\.(proj_mlp|proj_out)$")
_CLIP_ATTN = r"^text_encoder\..*\.self_attn\.(q_proj|k_proj|v_proj|out_proj)$"
_CLIP_MLP = r"^text_encoder\..*\.mlp\.(fc1|fc2)$"
_T5_ATTN = r"^text_encoder_2\..*\.SelfAttention\.(q|k|v|o)$"
_T5_MLP = r"^text_encoder_2\..*\.DenseReluDense\.(wi_0|wi_1|wo)$"

DECLARATION = FamilyDeclaration(
    name="flux",
    label="FLUX.1",
    part_specs=(
        PartSpec("text_encoder", "text_encoder", "lora_te1"),
        PartSpec("text_encoder_2", "text_encoder_2", "lora_te2"),
        PartSpec("transformer", "transformer", "lora_transformer", default_train=True),
        PartSpec("vae", "vae", None),
    ),
    bucket_quantum=64,
    layer_presets={
        "attn": ([_DIT_ATTN, _CLIP_ATTN, _T5_ATTN], False),
        "attn-mlp": ([_DIT_ATTN, *_DIT_MLP, _CLIP_ATTN, _CLIP_MLP, _T5_ATTN, _T5_MLP], False),
        "all-linear": ([r"^(transformer|text_encoder|text_encoder_2)\."], False),
        "all": ([r"^(transformer|text_encoder|text_encoder_2)\."], True),
    },
    denoiser_part="transformer",
    flow_matching=True,
    negative_prompt=False,  # guidance-distilled: FluxPipeline samples without a negative prompt
    implementation="modules.model.flux:FluxFamily",
)
