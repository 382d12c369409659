"""FIBO Edit adapter keys. ComfyUI has no FIBO model (no Bria architecture in its comfy/ldm/ or
supported_models.py; the ComfyUI nodes for FIBO wrap diffusers' pipelines), so the names are
diffusers' own module names (BriaFiboTransformer2DModel, SmolLM3ForCausalLM):

- diffusers: `transformer.<module>` (`transformer.transformer_blocks.0.attn.to_q`,
  `transformer.single_transformer_blocks.0.proj_mlp`) and `text_encoder.<module>`
  (`text_encoder.model.layers.0.self_attn.q_proj`), both of which
  BriaFiboEditPipeline.load_lora_weights (FluxLoraLoaderMixin) reads. The format the presets write.
- kohya: `lora_unet_<diffusers module with _>`, `lora_te_<module with _>`; diffusers' FLUX loader
  reads `lora_unet_` names as FLUX.1's original layers, which these are not, and refuses the file
  ("Incompatible keys"), so a kohya file is not for diffusers (diffusers_refuses below).
- comfy: none (output.format 'comfy' is refused before training, naming 'kohya').
"""

from __future__ import annotations

from modules.model.keys.layout import KeyLayout

FIBO_EDIT_KEYS = KeyLayout(
    diffusers_refuses={"kohya": "BriaFiboEditPipeline.load_lora_weights reads lora_unet_ names as FLUX.1's "
                                "original layers, which FIBO's are not, and refuses the file; write "
                                "output.format 'diffusers' for diffusers"},
)
