"""The Bria FIBO Edit family (an edit model: a FLUX-style transformer read by SmolLM3, conditioned
on reference images), as the config and the GUI see it (torch-free); its implementation:
modules/model/fibo_edit.py."""

from __future__ import annotations

from modules.config.family_declaration import FamilyDeclaration, PartSpec

# the joint blocks' image and text streams, the single blocks' attention
_DIT_ATTN = (r"^transformer\.(transformer_blocks|single_transformer_blocks)\.\d+\.attn\."
             r"(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$")
_DIT_MLP = (r"^transformer\.transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)$",
            r"^transformer\.single_transformer_blocks\.\d+\.(proj_mlp|proj_out)$")
_TE_ATTN = r"^text_encoder\..*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)$"
_TE_MLP = r"^text_encoder\..*\.mlp\.(gate_proj|up_proj|down_proj)$"

DECLARATION = FamilyDeclaration(
    name="fibo_edit",
    label="FIBO Edit",
    part_specs=(
        PartSpec("text_encoder", "text_encoder", "lora_te"),
        PartSpec("transformer", "transformer", "lora_unet", default_train=True),
        PartSpec("vae", "vae", None),
    ),
    # the VAE's 16x (BriaFiboEditPipeline.vae_scale_factor) times the 2x2 patches a patching model takes
    bucket_quantum=32,
    layer_presets={
        "attn": ([_DIT_ATTN, _TE_ATTN], False),
        "attn-mlp": ([_DIT_ATTN, *_DIT_MLP, _TE_ATTN, _TE_MLP], False),
        "all-linear": ([r"^(transformer|text_encoder)\."], False),
        "all": ([r"^(transformer|text_encoder)\."], True),
    },
    denoiser_part="transformer",
    flow_matching=True,
    # BriaFiboEditPipeline takes a list of references (each on its own RoPE time plane); this bound
    # keeps a sample's sequence at most 5x the target's. A sample prompt may have none (the pipeline
    # then generates from the instruction at the prompt's size) or as many
    control_images=4,
    prompt_control_images=(0, 4),
    planned_control_images=1,  # an edit pair: a preset is planned with one reference
    implementation="modules.model.fibo_edit:FiboEditFamily",
)
