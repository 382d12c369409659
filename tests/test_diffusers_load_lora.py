"""diffusers' `load_lora_weights` on every family's own pipeline (family.pipeline(), tiny models)
and every output format: a LoRA on the attention/MLP layers of every part that carries adapters
loads with exactly the adapters the run's warning does not name as dropped (counted in peft's
LoraLayers), or the file is refused where docs/formats.md says so (pinned below, with why); the
save check's diffusers entry (formats/files.py diffusers_report) counts the same."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import train_config

from modules.adapters.adapter_set import build_adapter_set
from modules.adapters.formats.files import (
    AdapterFileError,
    check_output_format,
    diffusers_report,
    format_warnings,
    save_adapter_file,
)
from modules.config.train_config import AdapterConfig

FAMILIES = ("sd15", "sdxl", "flux", "z_image", "flux2", "qwen_image", "chroma", "sd3", "wan", "krea2", "fibo2", "fibo_edit", "anima")
FORMATS = ("kohya", "comfy", "diffusers")
# (family, format) -> (the exception diffusers raises, why): the refusals docs/formats.md names
REFUSED = {
    ("sd15", "comfy"): (ValueError, "ComfyUI's own layout: diffusers reads kohya or diffusers files"),
    ("sdxl", "comfy"): (ValueError, "ComfyUI's own layout: diffusers reads kohya or diffusers files"),
    # diffusers' kohya-FLUX converter hard-codes the released widths: real width in test_flux_kohya_files.py
    ("flux", "kohya"): (AssertionError, "tiny widths"), ("flux", "comfy"): (AssertionError, "tiny widths"),
    # ... and test_chroma_kohya_files.py
    ("chroma", "kohya"): (AssertionError, "tiny widths"), ("chroma", "comfy"): (AssertionError, "tiny widths"),
    ("chroma", "diffusers"): (ValueError, "T5 adapters: the file is refused, as the run warns"),
    # the kohya/ComfyUI converter must read every key: UMT5 adapters make WanPipeline refuse the file
    ("wan", "kohya"): ((ValueError, IndexError), "T5 adapters: the file is refused, as the run warns"),
    ("wan", "comfy"): (ValueError, "T5 adapters: the file is refused, as the run warns"),
    # its Krea-2 converter reads ComfyUI's original names as peft lora_A/lora_B only and raises on the rest
    ("krea2", "comfy"): (ValueError, "lora_down/lora_up/alpha: the file is refused, as the run warns"),
    # every key must name "lora": the Qwen3-VL adapters' alphas under text_encoders. do not
    ("krea2", "kohya"): (ValueError, "text-encoder alphas: the file is refused, as the run warns"),
    # FIBO Edit's FLUX loader reads lora_unet_ names as FLUX.1's original layers and raises on FIBO's
    ("fibo_edit", "kohya"): (ValueError, "diffusers names under kohya prefixes: refused, as the run warns"),
    # AnimaModularPipeline's loader wants "lora" in every key: ComfyUI-named files' alphas are not
    ("anima", "kohya"): (ValueError, "alphas without 'lora': the file is refused, as the run warns"),
    ("anima", "comfy"): (ValueError, "alphas without 'lora': the file is refused, as the run warns"),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_family_model, tmp_path_factory, shape_images):
    from modules.config.families import get_family_class

    name = request.param
    loaded = get_family_class(name)(train_config(tiny_family_model(name), shape_images,
                                                 tmp_path_factory.mktemp(name), {"model": {"family": name}}))
    loaded.load()
    return loaded


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_lora_weights_loads_what_the_run_does_not_warn_of(family, fmt, tmp_path):
    from peft.tuners.lora import LoraLayer

    parts = [spec.name for spec in family.part_specs if spec.adapter_prefix]
    adapters = build_adapter_set(family, AdapterConfig(type="lora", rank=2, layer_preset="attn-mlp"), parts,
                                 torch.device("cpu"), fmt)
    try:
        if fmt == "comfy" and not (family.key_layout.comfy or family.key_layout.comfy_is_kohya):
            with pytest.raises(AdapterFileError, match="no ComfyUI key layout"):  # refused before training
                check_output_format(fmt, adapters, family)
            return
        check_output_format(fmt, adapters, family)
        warned = [w for w in format_warnings(fmt, adapters, family) if "load_lora_weights" in w]
        dropped = sum(int(m.group(1)) for w in warned if (m := re.search(r"will not load (\d+) of these", w)))
        report = diffusers_report(fmt, adapters, family)  # what each save's check says of diffusers
        path = tmp_path / "lora.safetensors"
        save_adapter_file(path, adapters, family, fmt, torch.float32, {})
        total = len(adapters)
    finally:
        adapters.unhook()
    pipe = family.pipeline()
    try:
        if (family.name, fmt) in REFUSED:
            error, why = REFUSED[family.name, fmt]
            with pytest.raises(error):
                pipe.load_lora_weights(str(path))
            if why.startswith("T5"):  # said before training, and the save check counts nothing applied
                assert any("load_lora_weights refuses the whole file" in w and "text_encoder." in w for w in warned), warned
                assert report["applied"] == 0 and len(report["dropped"]) == total
            if why.startswith("ComfyUI"):
                assert report["applied"] == 0 and len(report["dropped"]) == total
                assert any("load_lora_weights refuses ComfyUI's ldm-named layout" in w for w in warned), warned
            if family.diffusers_refuses(fmt):  # the key layout says so: warned, nothing counted as applied
                assert report["applied"] == 0 and len(report["dropped"]) == total
                assert any(family.diffusers_refuses(fmt) in w for w in warned), warned
            return
        pipe.load_lora_weights(str(path))
        loaded = sum(isinstance(m, LoraLayer) for part in parts for m in getattr(pipe, part).modules())
        if family.diffusers_refuses(fmt):  # read without an error, and nothing loaded (FIBO-2's kohya names)
            assert loaded == 0 and report["applied"] == 0 and len(report["dropped"]) == total
            assert any(family.diffusers_refuses(fmt) in w for w in warned), warned
            return
        assert loaded == total - dropped, (loaded, total, warned)
        assert report["applied"] == loaded and report["total"] == total
    finally:
        pipe.unload_lora_weights()
