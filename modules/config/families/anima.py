"""The Anima family, as the config and the GUI see it (torch-free); its implementation:
modules/model/anima.py."""

from __future__ import annotations

from modules.config.family_declaration import FamilyDeclaration, PartSpec

_DIT_ATTN = r"^transformer\..*\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)$"
_DIT_MLP = r"^transformer\..*\.ff\.net\.(0\.proj|2)$"
_ADAPTER_ATTN = r"^text_conditioner\..*\.(self_attn|cross_attn)\.(q_proj|k_proj|v_proj|o_proj)$"
_ADAPTER_MLP = r"^text_conditioner\..*\.mlp\.(0|2)$"
_TE_ATTN = r"^text_encoder\..*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)$"
_TE_MLP = r"^text_encoder\..*\.mlp\.(gate_proj|up_proj|down_proj)$"

DECLARATION = FamilyDeclaration(
    name="anima",
    label="Anima",
    part_specs=(
        PartSpec("text_encoder", "text_encoder", "lora_te"),
        # the LLM adapter (ComfyUI's `llm_adapter`, inside its diffusion model: kohya names lora_unet_llm_adapter_...)
        PartSpec("text_conditioner", "text_conditioner", "lora_unet"),
        PartSpec("transformer", "transformer", "lora_unet", default_train=True),
        PartSpec("vae", "vae", None),
    ),
    bucket_quantum=16,  # 8x VAE, 2x2 patches
    layer_presets={
        "attn": ([_DIT_ATTN, _ADAPTER_ATTN, _TE_ATTN], False),
        "attn-mlp": ([_DIT_ATTN, _DIT_MLP, _ADAPTER_ATTN, _ADAPTER_MLP, _TE_ATTN, _TE_MLP], False),
        "all-linear": ([r"^(transformer|text_conditioner|text_encoder)\."], False),
        "all": ([r"^(transformer|text_conditioner|text_encoder)\."], True),
    },
    denoiser_part="transformer",
    flow_matching=True,
    implementation="modules.model.anima:AnimaFamily",
)
