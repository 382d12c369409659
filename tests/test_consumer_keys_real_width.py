"""Issue 27 at real-size key names: every family's released architecture (resources/model_configs,
built on the meta device: no weights), a LoRA on the attention and MLP layers of the denoiser and
every text encoder, saved as kohya and as comfy keys, in both key layouts (a LoRA stacked onto
fused layers, a LoHa per module): ComfyUI's key
map applies every one of them, and Forge's (for the families Forge has) every key of a LoRA; of
the LoHa Forge drops only the per-module q/k/v keys of Chroma and SD3 (it maps those
models by their own fused weights' names alone: docs/formats.md). The real block counts, widths
and encoder depths; the maths of the patches: test_comfyui_patch_numbers.py (tiny models)."""

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

FAMILIES = ("sd15", "sdxl", "flux", "chroma", "sd3", "z_image", "flux2", "flux2-dev", "qwen_image", "wan", "krea2", "anima")
# the two key layouts a kohya file has: LoRA stacked onto an original fused layer (q/k/v as one
# `..._qkv` key), and one key per diffusers module (LoHa here; LoKr, DoRA and OFT name their keys
# as LoHa or LoRA do: test_consumer_keys.py checks every algorithm on tiny models)
ALGORITHMS = {"lora": {"type": "lora", "rank": 2}, "loha": {"type": "loha", "rank": 2}}


@pytest.mark.parametrize("case", FAMILIES)
def test_comfyui_and_forge_apply_every_key_of_real_width_files(case):
    name, _, variant = case.partition("-")
    config = build_config([{"model": {"family": name}}])
    family = build_architecture(config, {part: "bfloat16" for part in config.model.parts}, variant or None).family
    parts = [spec.name for spec in family.part_specs if spec.adapter_prefix]
    maps = {consumer: consumer.stems(family) for consumer in (comfyui, forge)}
    assert maps[comfyui] is not None and (maps[forge] is not None) == (name in ("sd15", "sdxl", "flux", "chroma", "sd3"))
    for algorithm, options in ALGORITHMS.items():
        adapters = build_adapter_set(family, AdapterConfig(layer_preset="attn-mlp", **options), parts,
                                     torch.device("meta"))
        try:
            files = {fmt: module_stems(file_state(adapters, family, fmt)) for fmt in ("kohya", "comfy")}
            encoder_adapters = sum(adapters.part_of[n] != family.denoiser_part for n in adapters.modules)
        finally:
            adapters.unhook()
        assert encoder_adapters > 0  # the text encoders' keys are in the files checked, not only the denoiser's
        for consumer, known in maps.items():
            for fmt, stems in files.items():
                missing = stems - known if known is not None else set()
                if consumer is forge and algorithm != "lora" and name in ("chroma", "sd3"):
                    missing = {s for s in missing if not s.startswith("lora_transformer_")}
                where = (consumer.NAME, algorithm, fmt, len(missing), sorted(missing)[:5])
                assert len(stems) > 100 and not missing, where
