"""Wan 2.2 A14B (text-to-video), as the config and the GUI see it (torch-free): Wan 2.1's parts with
two 14B transformers, the high-noise expert (`transformer`) and the low-noise expert
(`transformer_2`), split at the pipeline's `boundary_ratio`; each expert is a part of its own
(train, weight mode, offload). Implementation: modules/model/wan22.py."""

from __future__ import annotations

from modules.config.family_declaration import FamilyDeclaration, PartSpec

_DIT_ATTN = r"^transformer(_2)?\.blocks\..*\.attn[12]\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj)$"
_DIT_MLP = r"^transformer(_2)?\.blocks\..*\.ffn\.net\.(0\.proj|2)$"
_TE_ATTN = r"^text_encoder\..*\.SelfAttention\.(q|k|v|o)$"
_TE_MLP = r"^text_encoder\..*\.DenseReluDense\.(wi_0|wi_1|wo)$"

DECLARATION = FamilyDeclaration(
    name="wan22",
    label="Wan 2.2 A14B",
    part_specs=(
        PartSpec("text_encoder", "text_encoder", "lora_te"),
        # the high-noise expert (timesteps >= boundary_ratio x 1000) and the low-noise one; their adapters
        # keep apart in a backup by prefix, and each is saved to a file of its own under the Wan names
        PartSpec("transformer", "transformer", "lora_unet", default_train=True),
        PartSpec("transformer_2", "transformer_2", "lora_unet2", default_train=True),
        PartSpec("vae", "vae", None),
    ),
    bucket_quantum=16,  # the VAE's 8x times the transformer's 2x2 patches
    layer_presets={
        "attn": ([_DIT_ATTN, _TE_ATTN], False),
        "attn-mlp": ([_DIT_ATTN, _DIT_MLP, _TE_ATTN, _TE_MLP], False),
        "all-linear": ([r"^(transformer|transformer_2|text_encoder)\."], False),
        "all": ([r"^(transformer|transformer_2|text_encoder)\."], True),
    },
    denoiser_part="transformer",
    flow_matching=True,
    implementation="modules.model.wan22:Wan22Family",
)
