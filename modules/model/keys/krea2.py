"""Krea-2 adapter keys. ComfyUI (comfy/ldm/krea2/model.py, SingleStreamDiT) and the Krea 2 reference
checkpoint hold the transformer under the original names (`blocks.0.attn.wq`, `blocks.0.mlp.gate`,
`txtfusion.refiner_blocks.1.attn.wo`, `first`, `tmlp.0`, `tproj.1`, `txtmlp.1`, `last.linear`, ...),
which diffusers' Krea2Transformer2DModel renamed (`transformer_blocks.0.attn.to_q`, `..ff.gate`,
`img_in`, `time_embed.linear_1`, ...); every Linear layer is one layer in both (no fused q/k/v):

- kohya: `lora_unet_<original module with _>` (`lora_unet_blocks_0_attn_wq`): ComfyUI's comfy/lora.py
  `model_lora_keys_unet` maps `lora_unet_<weight with _>` for every weight of any diffusion model.
  diffusers' Krea2LoraLoaderMixin has no rule for these names: it loads nothing from such a file.
- comfy: `diffusion_model.<original module>`: ComfyUI's generic name for every weight, and the
  names of the Krea 2 reference trainer. diffusers' `_convert_non_diffusers_krea2_lora_to_diffusers`
  reads these names, but only as peft's `lora_A`/`lora_B` with no `alpha`: it refuses a file of
  `lora_down`/`lora_up`/`alpha` tensors whole.
- diffusers: `transformer.<diffusers module>` (Krea2LoraLoaderMixin); ComfyUI maps these too: its
  Krea2 branch of `model_lora_keys_unet` adds, for every name of comfy/utils.py `krea2_to_diffusers`
  (exactly the Linear layers above), `<module>`, `diffusion_model.<module>`, `transformer.<module>`
  and `lycoris_<module with _>`.
- the Qwen3-VL language model: ComfyUI's own path `text_encoders.qwen3vl_4b.transformer.model.<module>`
  (comfy/text_encoders/krea2.py names the encoder `qwen3vl_4b`, its language model `model` with
  transformers' module names), in kohya and comfy files; neither diffusers' loader nor ComfyUI
  reads `text_encoder.<module>` from a diffusers file.
Read from comfyanonymous/ComfyUI (comfy/ldm/krea2/model.py at 08381b1a, comfy/text_encoders/krea2.py
at 1e32fc1e) and the Krea2 branch of comfy/lora.py as published.
"""

from __future__ import annotations

import re

from modules.model.keys.layout import ComfyStems, KeyLayout

_ATTN = {"to_q": "wq", "to_k": "wk", "to_v": "wv", "to_gate": "gate", "to_out.0": "wo"}
_BLOCK = r"(?:\w+\.)*?"  # a block may sit inside a wrapper module: named as the block's own layer
_ORIGINAL = (
    *((rf"transformer_blocks\.(\d+)\.{_BLOCK}attn\.{re.escape(d)}", "blocks.{}.attn." + o) for d, o in _ATTN.items()),
    (rf"transformer_blocks\.(\d+)\.{_BLOCK}ff\.(gate|up|down)", "blocks.{}.mlp.{}"),
    *((rf"text_fusion\.(layerwise_blocks|refiner_blocks)\.(\d+)\.{_BLOCK}attn\.{re.escape(d)}",
       "txtfusion.{}.{}.attn." + o) for d, o in _ATTN.items()),
    (rf"text_fusion\.(layerwise_blocks|refiner_blocks)\.(\d+)\.{_BLOCK}ff\.(gate|up|down)", "txtfusion.{}.{}.mlp.{}"),
    (r"text_fusion\.projector", "txtfusion.projector"),
    (r"img_in", "first"),
    (r"time_embed\.linear_1", "tmlp.0"),
    (r"time_embed\.linear_2", "tmlp.2"),
    (r"time_mod_proj", "tproj.1"),
    (r"txt_in\.linear_1", "txtmlp.1"),
    (r"txt_in\.linear_2", "txtmlp.3"),
    (r"final_layer\.linear", "last.linear"),
)
_COMPILED = tuple((re.compile(pattern), target) for pattern, target in _ORIGINAL)


def krea2_original_module_name(transformer, module_name: str) -> str:
    """The original Krea 2 (ComfyUI, reference checkpoint) name of a Krea2Transformer2DModel module."""
    for pattern, target in _COMPILED:
        match = pattern.fullmatch(module_name)
        if match:
            return target.format(*match.groups())
    raise ValueError(f"the Krea-2 transformer module {module_name!r} has no original Krea 2 name (keys/krea2.py)")


KREA2_KEYS = KeyLayout(
    kohya_names={"transformer": krea2_original_module_name},
    comfy={"transformer": ComfyStems("diffusion_model.", krea2_original_module_name)},
    comfy_text_encoders={"text_encoder": "qwen3vl_4b"},
    comfyui_skips={"text_encoder": (None, ("it reads Qwen3-VL adapters only under its own "
                                           "text_encoders.qwen3vl_4b.transformer.model. names"))},
    diffusers_refuses={"comfy": "load_lora_weights refuses the whole file: its Krea-2 converter reads the original "
                                "names only as peft lora_A/lora_B tensors without alpha and raises on a comfy file's "
                                "lora_down/lora_up/alpha (output.format 'diffusers' loads in diffusers and ComfyUI)"},
)
