"""Chroma adapter keys (the whole story: modules/model/chroma.py's docstring).

- kohya: the transformer's LoRA on the original (lodestone's / ComfyUI's) layers, as sd-scripts
  names FLUX-architecture files (`lora_unet_double_blocks_0_img_attn_qkv`, q/k/v stacked,
  formats/fused.py), plus the distilled guidance layer (`lora_unet_distilled_guidance_layer_in_proj`,
  `..._layers_0_in_layer`, ...). Source: ComfyUI's comfy/lora.py `model_lora_keys_unet` maps
  `lora_unet_<original weight name with _>` for every weight of the diffusion model, and its
  Chroma model subclasses Flux (comfy/model_base.py `class Chroma(Flux)`), so the FLUX branch's
  diffusers names load too; the original names themselves are those of diffusers'
  `convert_chroma_transformer_checkpoint_to_diffusers` (single_file_utils).
- other algorithms (no stacking): a module that is a whole original layer keeps that layer's name
  (ChromaFamily.unstacked_kohya_stem), q/k/v and linear1's members `lora_transformer_<module>`
  (ComfyUI's FLUX diffusers-name map).
- T5: `lora_te1_<module>`: comfy/lora.py `model_lora_keys_clip` numbers the t5xxl encoder
  `lora_te{1 + clip_g + clip_l}`, 1 for Chroma's lone T5.
- comfy: ComfyUI reads the kohya layout above for every layer (ChromaFamily.file_layout).
- diffusers: `transformer.<module>`, `text_encoder.<module>`: ChromaPipeline's FluxLoraLoaderMixin
  loads the transformer's (its T5 adapters it refuses: ChromaFamily.diffusers_refuses_key). ComfyUI
  reads a diffusers file's transformer keys through `flux_to_diffusers`, which has no distilled
  guidance layer, and T5 keys only under `lora_te1_` (comfyui_skips below).
"""

from __future__ import annotations

from modules.model.keys.flux import FLUX_TRANSFORMER_LAYERS
from modules.model.keys.layout import FusedLayer, KeyLayout, OriginalLayout

_APPROXIMATOR = "distilled_guidance_layer"
# released Chroma has 5 approximator layers; a layer the model lacks is left out (OriginalLayout)
_MAX_APPROXIMATOR_LAYERS = 16

CHROMA_TRANSFORMER_LAYERS = OriginalLayout(
    prefix="lora_unet",
    top=(
        FusedLayer("img_in", ("x_embedder",)),
        FusedLayer("txt_in", ("context_embedder",)),
        FusedLayer("final_layer_linear", ("proj_out",)),
        FusedLayer(f"{_APPROXIMATOR}_in_proj", (f"{_APPROXIMATOR}.in_proj",)),
        FusedLayer(f"{_APPROXIMATOR}_out_proj", (f"{_APPROXIMATOR}.out_proj",)),
        *(FusedLayer(f"{_APPROXIMATOR}_layers_{i}_{original}", (f"{_APPROXIMATOR}.layers.{i}.{linear}",))
          for i in range(_MAX_APPROXIMATOR_LAYERS)
          for original, linear in (("in_layer", "linear_1"), ("out_layer", "linear_2"))),
    ),
    # FLUX's blocks; Chroma's have no modulation layers, so those templates drop out
    blocks=FLUX_TRANSFORMER_LAYERS.blocks,
)

CHROMA_KEYS = KeyLayout(
    # LoHa/LoKr/OFT/DoRA do not stack q/k/v; a whole original layer keeps its name, which ComfyUI maps
    # for every weight: its `lora_transformer_<module>` map (comfy/utils.py flux_to_diffusers) has no
    # distilled guidance layer
    whole_layer_original_names=("transformer",),
    # ComfyUI's Chroma model is a Flux model (comfy/model_base.py `class Chroma(Flux)`) and reads the
    # original layer names as FLUX's
    comfy_is_kohya=True,
    comfyui_skips={
        "transformer": (r"^distilled_guidance_layer\.", "its FLUX diffusers-name map has no distilled guidance layer"),
        "text_encoder": (None, "it reads T5 adapters only under kohya's lora_te1_ names"),
    },
    original_layers={"transformer": CHROMA_TRANSFORMER_LAYERS},
)
