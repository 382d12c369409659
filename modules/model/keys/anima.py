"""Anima adapter keys. ComfyUI (comfy/ldm/anima/model.py: `Anima(MiniTrainDIT)`, the Cosmos-Predict2
DiT of comfy/ldm/cosmos/predict2.py with an `llm_adapter`) holds the transformer under the original
Cosmos-Predict2 names, which diffusers' CosmosTransformer3DModel renamed; the LLM adapter keeps the
same names in both (diffusers' AnimaTextConditioner = ComfyUI's LLMAdapter: `embed`, `blocks.N.
self_attn.q_proj`, `cross_attn`, `mlp.0`/`mlp.2`, `out_proj`, `norm`). The renames below are the
inverse of diffusers' `_convert_non_diffusers_anima_lora_to_diffusers` (loaders/lora_conversion_utils.py)
and of its Cosmos 2 single-file converter:

- kohya: `lora_unet_<original module with _>` (`lora_unet_blocks_0_self_attn_q_proj`,
  `lora_unet_llm_adapter_blocks_0_cross_attn_k_proj`): ComfyUI's comfy/lora.py `model_lora_keys_unet`
  maps `lora_unet_<weight with _>` for every weight of a diffusion model (it has no Anima branch:
  no diffusers names); diffusers' Anima loader reads only `diffusion_model.` and its own keys, so it
  loads nothing from a kohya file (AnimaFamily.diffusers_skips_key).
- comfy: `diffusion_model.<original module>` (`diffusion_model.llm_adapter.<module>` for the adapter),
  the generic name `model_lora_keys_unet` maps; diffusers' converter reads these names, but its loader
  refuses a file with a key without `lora` in it (the kohya `.alpha`), so it refuses comfy files.
- diffusers: `transformer.<diffusers module>`, `text_conditioner.<module>` (AnimaLoraLoaderMixin,
  which loads both); ComfyUI core maps none of these (comfyui_skips).
- the Qwen3 0.6B text encoder: ComfyUI's own path `text_encoders.qwen3_06b.transformer.model.<module>`
  (comfy/text_encoders/anima.py names it `qwen3_06b`); no diffusers loader reads text-encoder adapters.
"""

from __future__ import annotations

import re

from modules.model.keys.layout import ComfyStems, KeyLayout

# diffusers module name (regex, full match) -> the original Cosmos-Predict2 name (a format string of its groups)
_ORIGINAL = (
    (r"transformer_blocks\.(\d+)\.attn1\.to_q", "blocks.{}.self_attn.q_proj"),
    (r"transformer_blocks\.(\d+)\.attn1\.to_k", "blocks.{}.self_attn.k_proj"),
    (r"transformer_blocks\.(\d+)\.attn1\.to_v", "blocks.{}.self_attn.v_proj"),
    (r"transformer_blocks\.(\d+)\.attn1\.to_out\.0", "blocks.{}.self_attn.output_proj"),
    (r"transformer_blocks\.(\d+)\.attn2\.to_q", "blocks.{}.cross_attn.q_proj"),
    (r"transformer_blocks\.(\d+)\.attn2\.to_k", "blocks.{}.cross_attn.k_proj"),
    (r"transformer_blocks\.(\d+)\.attn2\.to_v", "blocks.{}.cross_attn.v_proj"),
    (r"transformer_blocks\.(\d+)\.attn2\.to_out\.0", "blocks.{}.cross_attn.output_proj"),
    (r"transformer_blocks\.(\d+)\.ff\.net\.0\.proj", "blocks.{}.mlp.layer1"),
    (r"transformer_blocks\.(\d+)\.ff\.net\.2", "blocks.{}.mlp.layer2"),
    (r"transformer_blocks\.(\d+)\.norm1\.linear_(1|2)", "blocks.{}.adaln_modulation_self_attn.{}"),
    (r"transformer_blocks\.(\d+)\.norm2\.linear_(1|2)", "blocks.{}.adaln_modulation_cross_attn.{}"),
    (r"transformer_blocks\.(\d+)\.norm3\.linear_(1|2)", "blocks.{}.adaln_modulation_mlp.{}"),
    (r"norm_out\.linear_(1|2)", "final_layer.adaln_modulation.{}"),
    (r"proj_out", "final_layer.linear"),
    (r"time_embed\.t_embedder\.linear_(1|2)", "t_embedder.1.linear_{}"),
    (r"patch_embed\.proj", "x_embedder.proj.1"),
    (r"crossattn_proj\.0", "crossattn_proj.0"),
)
# a block may sit inside a wrapper module (`transformer_blocks.0.<wrapper>.attn1.to_q`): named as the block's own
_COMPILED = tuple((re.compile(pattern.replace(r"transformer_blocks\.(\d+)\.", r"transformer_blocks\.(\d+)\.(?:\w+\.)*?")),
                   target) for pattern, target in _ORIGINAL)


def anima_original_module_name(transformer, module_name: str) -> str:
    """The original Cosmos-Predict2 (ComfyUI) name of a diffusers CosmosTransformer3DModel module."""
    for pattern, target in _COMPILED:
        match = pattern.fullmatch(module_name)
        if match:
            return target.format(*match.groups())
    raise ValueError(f"the Anima transformer module {module_name!r} has no original Cosmos name (keys/anima.py)")


def llm_adapter_module_name(text_conditioner, module_name: str) -> str:
    """ComfyUI's name of an AnimaTextConditioner module: the same path under the diffusion model's `llm_adapter`."""
    return f"llm_adapter.{module_name}"


ANIMA_KEYS = KeyLayout(
    kohya_names={"transformer": anima_original_module_name, "text_conditioner": llm_adapter_module_name},
    comfy={"transformer": ComfyStems("diffusion_model.", anima_original_module_name),
           "text_conditioner": ComfyStems("diffusion_model.", llm_adapter_module_name)},
    comfy_text_encoders={"text_encoder": "qwen3_06b"},
    comfyui_skips={"transformer": (None, ("it maps Anima adapters only under the original Cosmos names "
                                          "(output.format 'comfy' or 'kohya')")),
                   "text_conditioner": (None, ("it maps the LLM adapter's adapters only under the diffusion model's "
                                               "llm_adapter. names (output.format 'comfy' or 'kohya')")),
                   "text_encoder": (None, ("it reads Qwen3 adapters only under its own "
                                           "text_encoders.qwen3_06b.transformer.model. names"))},
    diffusers_refuses={"comfy": "load_lora_weights refuses ComfyUI-layout Anima files: its converter takes them, "
                                "but the loader wants `lora` in every key and the file's `.alpha` keys have none "
                                "(use output.format 'diffusers' for diffusers)"},
)
