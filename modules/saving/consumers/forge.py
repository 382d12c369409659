"""Forge's (and A1111's built-in Lora extension's) LoRA key map, per family.

Reflects lllyasviel/stable-diffusion-webui-forge at commit dfdcbab6 (2025-06-26, its newest;
the maps below were first read at 00f1cd36, 2024-08-13, and every name read there is still
mapped) backend/patcher/lora.py over packages_3rdparty/comfyui_lora_collection/lora.py:
ComfyUI's denoiser names (FLUX's included), a UNet's diffusers names with and without `unet.`
(attention as `processor.to_q`), and CLIP names with the text projections, without ComfyUI's
generic `text_encoders.<k>`; T5: `lora_te1_`/`lora_te2_`/`lora_te3_`.

SD3.5 (backend/nn/mmditx.py, SAI's MMDiT) and Chroma (backend/nn/chroma.py, lodestone's layer
names) load too, but only under their own weights' names, `lora_unet_<weight with _>` and
`diffusion_model.<weight>`: Forge's SD3 diffusers-name map is commented out, and its FLUX
diffusers-name map is taken only when the model's repo name says "flux" (Chroma's is "Chroma").
So an adapter a kohya file writes per diffusers module (`lora_transformer_...`: LoHa/LoKr/OFT/DoRA
on q/k/v, which do not stack onto the fused layer) is not loaded by Forge. Forge has no Z-Image,
FLUX.2, Qwen-Image or Wan.
"""

from __future__ import annotations

from modules.saving.consumers import comfyui

NAME = "Forge"
VERSION = "commit dfdcbab6 of 2025-06-26 (backend/patcher/lora.py over its vendored comfyui_lora_collection)"


def sd_flux_stems(family) -> set[str]:
    stems = {s for s in comfyui.sd_flux_stems(family) if not s.startswith("text_encoders.")}
    if family.name == "flux":
        stems |= comfyui.t5_stems(family, ("te1", "te2", "te3"))
    else:  # model_lora_keys_unet: diffusers names bare and under `unet.`
        stems |= {f"{prefix}{s}" for s in comfyui.unet_diffusers_stems(family) for prefix in ("", "unet.")}
    return stems - comfyui.clip_stems(family, generic=True) | comfyui.clip_stems(family, generic=False)


def _own_weight_stems(original_names) -> set[str]:
    """model_lora_keys_unet for every weight of the diffusion model: `lora_unet_<name with _>` and the name itself."""
    return {f"lora_unet_{k.replace('.', '_')}" for k in original_names} | {f"diffusion_model.{k}" for k in original_names}


def chroma_stems(family) -> set[str]:
    # T5: backend/patcher/lora.py's `lora_te1_`/`te2_`/`te3_` over `t5xxl.transformer.` (Chroma's lone encoder)
    keys = [k.removesuffix(".weight") for k in family.parts["text_encoder"].state_dict() if k.endswith(".weight")]
    t5 = {f"lora_{p}_{k.replace('.', '_')}" for p in ("te1", "te2", "te3") for k in keys}
    return _own_weight_stems(comfyui.chroma_original_keys(family.transformer)) | t5


def sd3_stems(family) -> set[str]:
    # CLIP-L and CLIP-G as for SDXL (lora_te1_ / lora_te2_, the diffusers text_encoder(_2). names, the
    # projections); T5 (`t5xxl`): lora_te2_ and lora_te3_ (the vendored map) and lora_te1_ (backend's)
    keys = [k.removesuffix(".weight") for k in family.parts["text_encoder_3"].state_dict() if k.endswith(".weight")]
    t5 = {f"lora_{p}_{k.replace('.', '_')}" for p in ("te1", "te2", "te3") for k in keys}
    own = set(comfyui.mmdit_to_diffusers(family.transformer).values())
    return _own_weight_stems(own) | comfyui.clip_stems(family, generic=False) | t5


MAPS = {"sd15": sd_flux_stems, "sdxl": sd_flux_stems, "flux": sd_flux_stems, "chroma": chroma_stems, "sd3": sd3_stems}


def stems(family) -> set[str] | None:
    """Every key stem Forge applies for this family, or None: Forge has no such model (or not rebuilt)."""
    build = MAPS.get(family.name)
    return build(family) if build else None
