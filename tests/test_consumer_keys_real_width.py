"""Issue 27 at real-size key names: every family's released architecture (resources/model_configs,
built on the meta device: no weights), a LoRA on the attention and MLP layers of the denoiser and
every text encoder, saved as kohya and as comfy keys: ComfyUI's key map (and Forge's, for the
families Forge has) applies every one of them. The tiny-model tests (test_consumer_keys.py) cover
every algorithm; this one the real block counts, widths and encoder depths."""

from __future__ import annotations

import pytest
import torch

from modules.adapters.adapter_set import build_adapter_set
from modules.adapters.formats.files import file_state
from modules.config.loading import build_config
from modules.config.train_config import AdapterConfig
from modules.plan.architecture import build_architecture
from modules.saving.consumers import comfyui, forge
from modules.saving.consumers.check import module_stems

FAMILIES = ("sd15", "sdxl", "flux", "chroma", "sd3", "z_image", "flux2", "flux2-dev", "qwen_image", "wan")


@pytest.mark.parametrize("case", FAMILIES)
def test_comfyui_and_forge_apply_every_key_of_a_real_width_lora(case):
    name, _, variant = case.partition("-")
    config = build_config([{"model": {"family": name}}])
    family = build_architecture(config, {part: "bfloat16" for part in config.model.parts}, variant or None).family
    parts = [spec.name for spec in family.part_specs if spec.adapter_prefix]
    adapters = build_adapter_set(family, AdapterConfig(type="lora", rank=2, layer_preset="attn-mlp"), parts,
                                 torch.device("meta"))
    try:
        files = {fmt: module_stems(file_state(adapters, family, fmt)) for fmt in ("kohya", "comfy")}
        encoder_adapters = sum(adapters.part_of[n] != family.denoiser_part for n in adapters.modules)
    finally:
        adapters.unhook()
    for consumer in (comfyui, forge):
        known = consumer.stems(family)
        if known is None:  # the tool has no such model (forge: Z-Image, FLUX.2, Qwen-Image, Wan)
            assert consumer is forge, name
            continue
        for fmt, stems in files.items():
            assert len(stems) > 100 and not stems - known, (consumer.NAME, fmt, len(stems - known), sorted(stems - known)[:5])
    assert encoder_adapters > 0  # the text encoders' keys are in the files checked, not only the denoiser's
