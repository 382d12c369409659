"""The Stable Diffusion 3.5 family, as the config and the GUI see it (torch-free); its implementation:
modules/model/sd3.py."""

from __future__ import annotations

from modules.config.family_declaration import FamilyDeclaration, PartSpec

_DIT_ATTN = (r"^transformer\..*\.(attn|attn2)\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|"
             r"to_add_out)$")
_DIT_MLP = r"^transformer\.transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)$"
_CLIP_ATTN = r"^text_encoder(_2)?\..*\.self_attn\.(q_proj|k_proj|v_proj|out_proj)$"
_CLIP_MLP = r"^text_encoder(_2)?\..*\.mlp\.(fc1|fc2)$"
_T5_ATTN = r"^text_encoder_3\..*\.SelfAttention\.(q|k|v|o)$"
_T5_MLP = r"^text_encoder_3\..*\.DenseReluDense\.(wi_0|wi_1|wo)$"
_TEXT_PARTS = r"^(transformer|text_encoder|text_encoder_2|text_encoder_3)\."

DECLARATION = FamilyDeclaration(
    name="sd3",
    label="Stable Diffusion 3.5",
    part_specs=(
        PartSpec("text_encoder", "text_encoder", "lora_te1"),
        PartSpec("text_encoder_2", "text_encoder_2", "lora_te2"),
        PartSpec("text_encoder_3", "text_encoder_3", "lora_te3"),
        PartSpec("transformer", "transformer", "lora_transformer", default_train=True),
        PartSpec("vae", "vae", None),
    ),
    bucket_quantum=64,  # 8x VAE downscale times the 2x2 patches, rounded up as for Flux
    layer_presets={
        "attn": ([_DIT_ATTN, _CLIP_ATTN, _T5_ATTN], False),
        "attn-mlp": ([_DIT_ATTN, _DIT_MLP, _CLIP_ATTN, _CLIP_MLP, _T5_ATTN, _T5_MLP], False),
        "all-linear": ([_TEXT_PARTS], False),
        "all": ([_TEXT_PARTS], True),
    },
    denoiser_part="transformer",
    flow_matching=True,
    implementation="modules.model.sd3:SD3Family",
)
