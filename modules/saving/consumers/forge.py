"""Forge's (and A1111's built-in Lora extension's) LoRA key map, per family.

Reflects lllyasviel/stable-diffusion-webui-forge (classic, commit 00f1cd36) backend/patcher/lora.py
over packages_3rdparty/comfyui_lora_collection/lora.py: ComfyUI's denoiser names (FLUX's included),
a UNet's diffusers names with and without `unet.` (attention as `processor.to_q`), and CLIP names
with the text projections, without ComfyUI's generic `text_encoders.<k>`; T5:
`lora_te1_`/`lora_te2_`/`lora_te3_`. Forge (classic) has no Z-Image, FLUX.2 or Qwen-Image.
"""

from __future__ import annotations

from modules.saving.consumers import comfyui

NAME = "Forge"
VERSION = "classic (commit 00f1cd36: backend/patcher/lora.py over its vendored comfyui_lora_collection)"


def sd_flux_stems(family) -> set[str]:
    stems = {s for s in comfyui.sd_flux_stems(family) if not s.startswith("text_encoders.")}
    if family.name == "flux":
        stems |= comfyui.t5_stems(family, ("te1", "te2", "te3"))
    else:  # model_lora_keys_unet: diffusers names bare and under `unet.`
        stems |= {f"{prefix}{s}" for s in comfyui.unet_diffusers_stems(family) for prefix in ("", "unet.")}
    return stems - comfyui.clip_stems(family, generic=True) | comfyui.clip_stems(family, generic=False)


MAPS = {"sd15": sd_flux_stems, "sdxl": sd_flux_stems, "flux": sd_flux_stems}


def stems(family) -> set[str] | None:
    """Every key stem Forge applies for this family, or None: Forge has no such model (or not rebuilt)."""
    build = MAPS.get(family.name)
    return build(family) if build else None
