"""Qwen-Image adapter keys. Every tool names Qwen-Image's transformer by diffusers' own module names
(ComfyUI's comfy/ldm/qwen_image/model.py builds the same module tree, and diffusers' single-file
mapping for QwenImageTransformer2DModel is the identity), so no original layout and no stacking:

- kohya: `lora_unet_<diffusers module with _>` (`lora_unet_transformer_blocks_0_attn_to_q`,
  `lora_unet_transformer_blocks_0_img_mlp_net_0_proj`, `lora_unet_norm_out_linear`), as kohya's
  musubi-tuner writes Qwen-Image LoRAs. ComfyUI's comfy/lora.py `model_lora_keys_unet` maps
  `lora_unet_<weight name with _>` for every weight of any diffusion model; diffusers'
  `_convert_non_diffusers_qwen_lora_to_diffusers` (loaders/lora_conversion_utils.py) reads them
  back, keeping the underscores of `to_q`, `add_k_proj`, `img_mlp`, `txt_mod`, ... and mapping the
  top-level `img_in`, `txt_in`, `proj_out`, `norm_out_linear`, `time_text_embed_...` explicitly.
  The Qwen2.5-VL language model: ComfyUI's own path `text_encoders.qwen25_7b.transformer.model.<module>`
  (`model_lora_keys_clip` maps only `text_encoders.<weight>` for it, comfy/text_encoders/qwen_image.py
  names the encoder `qwen25_7b`); older `lora_te_<module>` files still load.
- comfy: `diffusion_model.<diffusers module>`: the generic name `model_lora_keys_unet` maps for every
  weight (and, for QwenImage models, also `<module>` and `transformer.<module>`); the text encoder
  as in kohya files.
- diffusers: `transformer.<module>` (QwenImageLoraLoaderMixin; ComfyUI maps these too for
  QwenImage models) and `text_encoder.<module>`, which neither diffusers' loader nor ComfyUI reads
  (QwenImageFamily.diffusers_skips_key, comfyui_skips below).
"""

from __future__ import annotations

from modules.model.keys.layout import ComfyStems, KeyLayout

QWEN_IMAGE_KEYS = KeyLayout(
    comfy={"transformer": ComfyStems("diffusion_model.")},
    comfy_text_encoders={"text_encoder": "qwen25_7b"},
    comfyui_skips={"text_encoder": (None, "it reads Qwen2.5-VL adapters only under its own "
                                          "text_encoders.qwen25_7b.transformer.model. names")},
)
