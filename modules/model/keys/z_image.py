"""Z-Image adapter keys, after ComfyUI's Z-Image (Lumina2 / NextDiT) model, whose attention is one
fused `attention.qkv` and whose output projection is `attention.out`:

- kohya: LoRA on those original layers, `lora_unet_layers_0_attention_qkv` (q/k/v stacked
  block-diagonally, formats/fused.py), which ComfyUI maps from its own weights and diffusers'
  Z-Image converter splits back; other algorithms, which do not stack, use ComfyUI's diffusers-name
  keys (`ZImageFamily.unstacked_kohya_stem`). The Qwen3 encoder: ComfyUI's own path
  `text_encoders.qwen3_4b.transformer.model.<module>` (model_lora_keys_clip maps only
  `text_encoders.<weight>` for it; comfy/text_encoders/z_image.py names the encoder `qwen3_4b`);
  older `lora_te_<module>` files still load. musubi-style `lora_unet_<diffusers module>` files
  are still read.
- comfy: `diffusion_model.layers.0.attention.to_q` (ComfyUI applies them to rows of the fused weight).
- diffusers: `transformer.<module>`, `text_encoder.<module>`.

Source of the names: ComfyUI's comfy/utils.py `z_image_to_diffusers` maps each diffusers weight
onto them (q/k/v as row offsets 0, dim, 2*dim of `attention.qkv`), and comfy/lora.py
`model_lora_keys_unet` keys LoRAs by `lora_unet_<its name with _>` and, for Lumina2 models, by
`diffusion_model.<diffusers name>` (Comfy-Org/ComfyUI).
"""

from __future__ import annotations

from modules.model.keys.layout import ComfyStems, FusedLayer, KeyLayout, OriginalLayout

# (ComfyUI's name, the diffusers modules it holds) in each refiner / main block
_BLOCK_LAYERS = (("attention.qkv", ("attention.to_q", "attention.to_k", "attention.to_v")),
                 ("attention.out", ("attention.to_out.0",)), ("feed_forward.w1", ("feed_forward.w1",)),
                 ("feed_forward.w2", ("feed_forward.w2",)), ("feed_forward.w3", ("feed_forward.w3",)),
                 ("adaLN_modulation.0", ("adaLN_modulation.0",)))
# outside the blocks: (ComfyUI's name, the diffusers module)
_TOP_LAYERS = (("x_embedder", "all_x_embedder.2-1"), ("final_layer.linear", "all_final_layer.2-1.linear"),
               ("final_layer.adaLN_modulation.1", "all_final_layer.2-1.adaLN_modulation.1"),
               ("t_embedder.mlp.0", "t_embedder.mlp.0"), ("t_embedder.mlp.2", "t_embedder.mlp.2"),
               ("cap_embedder.1", "cap_embedder.1"))

Z_IMAGE_TRANSFORMER_LAYERS = OriginalLayout(
    prefix="lora_unet",
    top=tuple(FusedLayer(original.replace(".", "_"), (member,)) for original, member in _TOP_LAYERS),
    blocks={stack: tuple(FusedLayer(f"{stack}_{{i}}_{original.replace('.', '_')}",
                                    tuple(f"{{block}}.{m}" for m in members))
                         for original, members in _BLOCK_LAYERS)
            for stack in ("noise_refiner", "context_refiner", "layers")},
)

Z_IMAGE_KEYS = KeyLayout(
    comfy={"transformer": ComfyStems("diffusion_model.")},
    comfy_text_encoders={"text_encoder": "qwen3_4b"},
    comfyui_skips={"text_encoder": (None, "it reads Qwen3 adapters only under its own "
                                          "text_encoders.qwen3_4b.transformer.model. names")},
    original_layers={"transformer": Z_IMAGE_TRANSFORMER_LAYERS},
)
