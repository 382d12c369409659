"""Wan 2.1 adapter keys. ComfyUI (comfy/ldm/wan/model.py) and musubi-tuner hold the transformer under
the original Wan names (`blocks.0.self_attn.q`, `blocks.0.ffn.0`, `head.head`, ...), which diffusers'
WanTransformer3DModel renamed (`blocks.0.attn1.to_q`, `blocks.0.ffn.net.0.proj`, `proj_out`):

- kohya: `lora_unet_<original module with _>` (`lora_unet_blocks_0_self_attn_q`), musubi-tuner's
  names; ComfyUI's comfy/lora.py `model_lora_keys_unet` maps `lora_unet_<weight with _>` for every
  weight of any diffusion model, and diffusers reads them back with
  `_convert_musubi_wan_lora_to_diffusers` (loaders/lora_conversion_utils.py), which takes only the
  blocks' attention and FFN layers and refuses a file with any other key (WanFamily.diffusers_refuses_key).
- comfy: `diffusion_model.<original module>`: ComfyUI's generic name for every weight; diffusers
  reads them with `_convert_non_diffusers_wan_lora_to_diffusers`, the blocks' layers and the
  text/time embedders, time projection and head.
- diffusers: `transformer.<diffusers module>` (WanLoraLoaderMixin); ComfyUI (0.3.64) has no Wan
  diffusers-name map, so it loads none of these (comfyui_skips).
- the UMT5 text encoder: ComfyUI's own path `text_encoders.umt5xxl.transformer.<module>`
  (comfy/text_encoders/wan.py names it `umt5xxl`; comfy/text_encoders/t5.py keeps transformers'
  T5 module names; `model_lora_keys_clip` maps `text_encoders.<weight>` for it and no `lora_te_`
  name), in both kohya and comfy files; diffusers' Wan loader reads no text-encoder adapters.
"""

from __future__ import annotations

import re

from modules.model.keys.layout import ComfyStems, KeyLayout

# diffusers module name (regex, full match) -> the original Wan name (a format string of its groups)
_ORIGINAL = (
    (r"blocks\.(\d+)\.attn1\.to_q", "blocks.{}.self_attn.q"),
    (r"blocks\.(\d+)\.attn1\.to_k", "blocks.{}.self_attn.k"),
    (r"blocks\.(\d+)\.attn1\.to_v", "blocks.{}.self_attn.v"),
    (r"blocks\.(\d+)\.attn1\.to_out\.0", "blocks.{}.self_attn.o"),
    (r"blocks\.(\d+)\.attn2\.to_q", "blocks.{}.cross_attn.q"),
    (r"blocks\.(\d+)\.attn2\.to_k", "blocks.{}.cross_attn.k"),
    (r"blocks\.(\d+)\.attn2\.to_v", "blocks.{}.cross_attn.v"),
    (r"blocks\.(\d+)\.attn2\.to_out\.0", "blocks.{}.cross_attn.o"),
    (r"blocks\.(\d+)\.attn2\.add_k_proj", "blocks.{}.cross_attn.k_img"),
    (r"blocks\.(\d+)\.attn2\.add_v_proj", "blocks.{}.cross_attn.v_img"),
    (r"blocks\.(\d+)\.ffn\.net\.0\.proj", "blocks.{}.ffn.0"),
    (r"blocks\.(\d+)\.ffn\.net\.2", "blocks.{}.ffn.2"),
    (r"condition_embedder\.text_embedder\.linear_1", "text_embedding.0"),
    (r"condition_embedder\.text_embedder\.linear_2", "text_embedding.2"),
    (r"condition_embedder\.time_embedder\.linear_1", "time_embedding.0"),
    (r"condition_embedder\.time_embedder\.linear_2", "time_embedding.2"),
    (r"condition_embedder\.time_proj", "time_projection.1"),
    (r"condition_embedder\.image_embedder\.ff\.net\.0\.proj", "img_emb.proj.1"),
    (r"condition_embedder\.image_embedder\.ff\.net\.2", "img_emb.proj.3"),
    (r"proj_out", "head.head"),
    (r"patch_embedding", "patch_embedding"),
)
# a block may sit inside a wrapper module (`blocks.0.<wrapper>.attn1.to_q`): named as the block's own layer
_COMPILED = tuple((re.compile(pattern.replace(r"blocks\.(\d+)\.", r"blocks\.(\d+)\.(?:\w+\.)*?")), target)
                  for pattern, target in _ORIGINAL)
# the modules diffusers' Wan converters read from a kohya or comfy file: the blocks' attention and FFN layers
DIFFUSERS_READS_BLOCK_LAYER = re.compile(r"^blocks\.\d+\.(?:\w+\.)*?(attn1\.(to_q|to_k|to_v|to_out\.0)|attn2\.(to_q|to_k|to_v|to_out\.0|"
                                r"add_k_proj|add_v_proj)|ffn\.(net\.0\.proj|net\.2))$")


def wan_original_module_name(transformer, module_name: str) -> str:
    """The original Wan (ComfyUI, musubi-tuner) name of a diffusers WanTransformer3DModel module."""
    for pattern, target in _COMPILED:
        match = pattern.fullmatch(module_name)
        if match:
            return target.format(*match.groups())
    raise ValueError(f"the Wan transformer module {module_name!r} has no original Wan name (keys/wan.py)")


WAN_KEYS = KeyLayout(
    kohya_names={"transformer": wan_original_module_name},
    comfy={"transformer": ComfyStems("diffusion_model.", wan_original_module_name)},
    comfy_text_encoder_prefixes={"text_encoder": "text_encoders.umt5xxl.transformer."},
    comfyui_skips={"transformer": (None, "it maps Wan adapters only under the original Wan names "
                                         "(output.format 'comfy' or 'kohya')"),
                   "text_encoder": (None, "it reads UMT5 adapters only under its own "
                                          "text_encoders.umt5xxl.transformer. names")},
)
