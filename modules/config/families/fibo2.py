"""The Bria FIBO-2 family, as the config and the GUI see it (torch-free); its implementation:
modules/model/fibo2.py."""

from __future__ import annotations

from modules.config.family_declaration import FamilyDeclaration, PartSpec

# the main blocks' and noise refiner's self-attention, the injection blocks' and the Perceiver's
# cross-attention to Qwen3-VL, the Perceiver's self-attention among its gist tokens
_DIT_ATTN = r"^transformer\..*\.(attention|cross_attention|self_attention)\.(to_q|to_k|to_v|to_out\.0)$"
_DIT_MLP = r"^transformer\..*\.(feed_forward|ffn)\.(w1|w2|w3)$"
# the text encoder's language model only: Qwen3-VL's vision tower is not trained (Fibo2Family.unreachable_prefixes)
_TE_ATTN = r"^text_encoder\.language_model\..*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)$"
_TE_MLP = r"^text_encoder\.language_model\..*\.mlp\.(gate_proj|up_proj|down_proj)$"

DECLARATION = FamilyDeclaration(
    name="fibo2",
    label="FIBO-2",
    part_specs=(
        PartSpec("text_encoder", "text_encoder", "lora_te"),
        PartSpec("transformer", "transformer", "lora_unet", default_train=True),
        PartSpec("vae", "vae", None),
    ),
    bucket_quantum=64,
    layer_presets={
        "attn": ([_DIT_ATTN, _TE_ATTN], False),
        "attn-mlp": ([_DIT_ATTN, _DIT_MLP, _TE_ATTN, _TE_MLP], False),
        "all-linear": ([r"^transformer\.", r"^text_encoder\.language_model\."], False),
        "all": ([r"^transformer\.", r"^text_encoder\.language_model\."], True),
    },
    denoiser_part="transformer",
    flow_matching=True,
    control_images=1,  # editing: BriaFibo2Pipeline(image=...) with one image (modules/model/fibo2.py)
    implementation="modules.model.fibo2:Fibo2Family",
)
