"""FLUX.1 adapter keys (the whole story: modules/model/flux.py's docstring).

- kohya: the transformer's LoRA under the original (BFL) layers, as sd-scripts writes FLUX files
  and diffusers' `_convert_kohya_flux_lora_to_diffusers` reads them (`lora_unet_double_blocks_0_img_attn_qkv`:
  q/k/v stacked into one LoRA, formats/fused.py); other algorithms per module
  (`lora_transformer_<diffusers module>`). Text encoders: `lora_te1_...` (CLIP-L), `lora_te2_...` (T5).
- ComfyUI's own layout fuses q/k/v as the kohya names do: a `comfy` file is the kohya one
  (FluxFamily.file_layout).
- diffusers: `transformer.<module>`, `text_encoder.text_model...`, `text_encoder_2.<module>`.
"""

from __future__ import annotations

from modules.model.keys.layout import FusedLayer, KeyLayout, OriginalLayout

# the original names of the transformer's layers (BFL's flux/model.py), diffusers' names as members
FLUX_TRANSFORMER_LAYERS = OriginalLayout(
    prefix="lora_unet",
    top=(
        FusedLayer("img_in", ("x_embedder",)),
        FusedLayer("txt_in", ("context_embedder",)),
        FusedLayer("final_layer_linear", ("proj_out",)),
        FusedLayer("final_layer_adaLN_modulation_1", ("norm_out.linear",), swap_halves=True),
        *(FusedLayer(f"{source}_{layer}", (f"time_text_embed.{target}.{linear}",))
          for source, target in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"),
                                 ("guidance_in", "guidance_embedder"))
          for layer, linear in (("in_layer", "linear_1"), ("out_layer", "linear_2"))),
    ),
    blocks={
        "transformer_blocks": (
            FusedLayer("double_blocks_{i}_img_attn_qkv", ("{block}.attn.to_q", "{block}.attn.to_k", "{block}.attn.to_v")),
            FusedLayer("double_blocks_{i}_txt_attn_qkv",
                       ("{block}.attn.add_q_proj", "{block}.attn.add_k_proj", "{block}.attn.add_v_proj")),
            FusedLayer("double_blocks_{i}_img_attn_proj", ("{block}.attn.to_out.0",)),
            FusedLayer("double_blocks_{i}_txt_attn_proj", ("{block}.attn.to_add_out",)),
            FusedLayer("double_blocks_{i}_img_mlp_0", ("{block}.ff.net.0.proj",)),
            FusedLayer("double_blocks_{i}_img_mlp_2", ("{block}.ff.net.2",)),
            FusedLayer("double_blocks_{i}_txt_mlp_0", ("{block}.ff_context.net.0.proj",)),
            FusedLayer("double_blocks_{i}_txt_mlp_2", ("{block}.ff_context.net.2",)),
            FusedLayer("double_blocks_{i}_img_mod_lin", ("{block}.norm1.linear",)),
            FusedLayer("double_blocks_{i}_txt_mod_lin", ("{block}.norm1_context.linear",)),
        ),
        "single_transformer_blocks": (
            FusedLayer("single_blocks_{i}_linear1",
                       ("{block}.attn.to_q", "{block}.attn.to_k", "{block}.attn.to_v", "{block}.proj_mlp")),
            FusedLayer("single_blocks_{i}_linear2", ("{block}.proj_out",)),
            FusedLayer("single_blocks_{i}_modulation_lin", ("{block}.norm.linear",)),
        ),
    },
)

FLUX_KEYS = KeyLayout(
    # ComfyUI's own FLUX layout fuses q/k/v like sd-scripts' names, and ComfyUI (comfy/lora.py
    # model_lora_keys_unet) and Forge read those names and OneTrainer's for every layer
    comfy_is_kohya=True,
    text_model_parts=("text_encoder",),
    comfyui_skips={"text_encoder_2": (None, "it reads T5 adapters only under kohya's lora_te2_/lora_te3_ names")},
    original_layers={"transformer": FLUX_TRANSFORMER_LAYERS},
)
