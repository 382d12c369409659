"""FLUX.2 adapter keys (the whole story: modules/model/flux2.py's docstring).

- kohya: the transformer's LoRA on the original (BFL) layers, `lora_unet_<original layer with _>`:
  `lora_unet_double_blocks_0_img_attn_qkv` (q/k/v stacked, formats/fused.py), `..._img_mlp_0`,
  `lora_unet_single_blocks_0_linear1` (one diffusers module there: to_qkv_mlp_proj), the shared
  modulations `lora_unet_double_stream_modulation_img_lin`, ... Sources: the original names are
  those diffusers' `convert_flux2_transformer_checkpoint_to_diffusers` (single_file_utils) renames;
  diffusers' `_convert_kohya_flux2_lora_to_diffusers` (lora_conversion_utils) reads these stems for
  the blocks, img_in, txt_in, time_in and final_layer_linear (not the modulations, guidance_in or
  the final adaLN: Flux2Family.diffusers_skips_key); ComfyUI's comfy/lora.py `model_lora_keys_unet`
  maps `lora_unet_<original weight name with _>` for every weight of the diffusion model.
- other algorithms (no stacking): a module that is a whole original layer keeps that layer's name
  (Flux2Family.unstacked_kohya_stem), except the final adaLN whose original swaps its halves;
  q/k/v members and that one `lora_transformer_<module>`: ComfyUI's Flux2 model is a Flux model
  (comfy/model_base.py `class Flux2(Flux)`), whose diffusers map (comfy/utils.py flux_to_diffusers)
  reads `lora_transformer_transformer_blocks_N_attn_to_q` as rows of `double_blocks.N.img_attn.qkv`
  and `norm_out.linear` with its halves swapped. Older `lora_unet_<module>` files still load.
- the text encoder: ComfyUI's own path `text_encoders.<encoder>.transformer.model.<module>`, encoder
  `qwen3_4b` / `qwen3_8b` (klein 4B / 9B) or `mistral3_24b` ([dev], comfy/text_encoders/flux.py
  Flux2TEModel); model_lora_keys_clip maps only `text_encoders.<weight>` for them. Older
  `lora_te_<module>` files still load. diffusers' Flux2 loader reads transformer adapters only.
- comfy: the kohya layout (Flux2Family.file_layout).
- diffusers: `transformer.<module>`, `text_encoder.<module>` (Flux2LoraLoaderMixin).
"""

from __future__ import annotations

from torch import nn

from modules.model.keys.layout import FusedLayer, KeyLayout, OriginalLayout


def comfy_encoder_name(encoder: nn.Module) -> str:
    """ComfyUI's name for the loaded FLUX.2 text encoder: Mistral-Small-3.1 for [dev], Qwen3-8B
    (4096 wide) for klein 9B, Qwen3-4B otherwise (smaller test encoders read as 4B)."""
    config = encoder.config
    if getattr(config, "model_type", "") == "mistral":
        return "mistral3_24b"
    return "qwen3_8b" if getattr(config, "hidden_size", 0) == 4096 else "qwen3_4b"


FLUX2_TRANSFORMER_LAYERS = OriginalLayout(
    prefix="lora_unet",
    top=(
        FusedLayer("img_in", ("x_embedder",)),
        FusedLayer("txt_in", ("context_embedder",)),
        FusedLayer("final_layer_linear", ("proj_out",)),
        # the original stores (shift, scale), diffusers (scale, shift): the converter swaps them
        FusedLayer("final_layer_adaLN_modulation_1", ("norm_out.linear",), swap_halves=True),
        *(FusedLayer(f"{source}_{layer}", (f"time_guidance_embed.{target}.{linear}",))
          for source, target in (("time_in", "timestep_embedder"), ("guidance_in", "guidance_embedder"))
          for layer, linear in (("in_layer", "linear_1"), ("out_layer", "linear_2"))),
        *(FusedLayer(f"{name}_lin", (f"{name}.linear",))
          for name in ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation")),
    ),
    blocks={
        "transformer_blocks": (
            FusedLayer("double_blocks_{i}_img_attn_qkv", ("{block}.attn.to_q", "{block}.attn.to_k", "{block}.attn.to_v")),
            FusedLayer("double_blocks_{i}_txt_attn_qkv",
                       ("{block}.attn.add_q_proj", "{block}.attn.add_k_proj", "{block}.attn.add_v_proj")),
            FusedLayer("double_blocks_{i}_img_attn_proj", ("{block}.attn.to_out.0",)),
            FusedLayer("double_blocks_{i}_txt_attn_proj", ("{block}.attn.to_add_out",)),
            FusedLayer("double_blocks_{i}_img_mlp_0", ("{block}.ff.linear_in",)),
            FusedLayer("double_blocks_{i}_img_mlp_2", ("{block}.ff.linear_out",)),
            FusedLayer("double_blocks_{i}_txt_mlp_0", ("{block}.ff_context.linear_in",)),
            FusedLayer("double_blocks_{i}_txt_mlp_2", ("{block}.ff_context.linear_out",)),
        ),
        "single_transformer_blocks": (
            FusedLayer("single_blocks_{i}_linear1", ("{block}.attn.to_qkv_mlp_proj",)),
            FusedLayer("single_blocks_{i}_linear2", ("{block}.attn.to_out",)),
        ),
    },
)

FLUX2_KEYS = KeyLayout(
    # LoHa/LoKr/OFT/DoRA do not stack q/k/v; a whole original layer keeps its name, and ComfyUI maps
    # `lora_unet_<original name>` for every weight
    whole_layer_original_names=("transformer",),
    comfy_is_kohya=True,
    unstacked_kohya_prefixes={"transformer": "lora_transformer"},
    comfy_text_encoders={"text_encoder": comfy_encoder_name},
    comfyui_skips={
        "text_encoder": (None, "it reads this text encoder's adapters only under its own "
                               "text_encoders.<encoder>.transformer.model. names"),
        # a diffusers file's `transformer.<module>` keys go through ComfyUI's FLUX map
        # (comfy/utils.py flux_to_diffusers), which has FLUX.1's module names: FLUX.2's attention
        # projections, embedders and final layers match, its other layers do not
        "transformer": (r"^(transformer_blocks\.\d+\.(ff|ff_context)\.|single_transformer_blocks\.|"
                        r"time_guidance_embed\.|(double_stream_modulation_img|double_stream_modulation_txt|"
                        r"single_stream_modulation)\.)",
                        "its FLUX diffusers-name map has FLUX.1's module names, not FLUX.2's feed-forward, "
                        "single-block, modulation and time/guidance layers"),
    },
    original_layers={"transformer": FLUX2_TRANSFORMER_LAYERS},
)
