"""FIBO-2 adapter keys. ComfyUI has no FIBO model (no Bria architecture in its comfy/ldm/ or
supported_models.py; Bria-AI/FIBO issue #2, "comfyui native support", is open; the ComfyUI nodes for
FIBO wrap diffusers' pipelines), so there is no ComfyUI layout to follow and the names are diffusers'
own module names (BriaFibo2Transformer2DModel, Qwen3VLModel: `language_model.layers.0.self_attn.q_proj`):

- diffusers: `transformer.<module>` (`transformer.layers.0.attention.to_q`,
  `transformer.layers.0.cross_attention.to_k`, `transformer.perceiver.layers.0.ffn.w1`), what
  BriaFibo2Pipeline.load_lora_weights (BriaFibo2LoraLoaderMixin) reads, and `text_encoder.<module>`,
  which it does not (Fibo2Family.diffusers_skips_key). The format the presets write.
- kohya: `lora_unet_<diffusers module with _>`, `lora_te_<module with _>` (the OneTrainer/musubi
  convention for a model without original names); diffusers has no converter for them, so
  load_lora_weights loads none of a kohya file (diffusers_refuses below).
- comfy: none (output.format 'comfy' is refused before training, naming 'kohya').
"""

from __future__ import annotations

from modules.model.keys.layout import KeyLayout

FIBO2_KEYS = KeyLayout(
    diffusers_refuses={"kohya": "BriaFibo2Pipeline.load_lora_weights has no converter for kohya names and loads "
                                "none of them; write output.format 'diffusers' for diffusers"},
)
