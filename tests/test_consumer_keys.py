"""Every key stem a saved file holds is one ComfyUI and Forge match, reproduced here from their
public loaders' key maps (facts, written independently), so renaming a stem breaks a test:

ComfyUI (comfy/lora.py, model_lora_keys_unet / model_lora_keys_clip):
- denoiser: for every `diffusion_model.<X>.weight` of its model (original/ldm/BFL layout):
  `lora_unet_<X with _>` and `diffusion_model.<X>`; for a UNet also `lora_unet_<diffusers module
  with _>` (unet_to_diffusers); for FLUX also, per diffusers module <D>:
  `transformer.<D>`, `lycoris_<D with _>`, `lora_transformer_<D with _>`;
- CLIP-L (`clip_l.transformer.text_model.encoder.layers.<b>.<c>`, c one of q/k/v/out_proj,
  fc1/fc2): `lora_te_text_model_encoder_layers_<b>_<c with _>`, `lora_te1_...`,
  `text_encoder.text_model.encoder.layers.<b>.<c>`; CLIP-G (with CLIP-L): `lora_te2_...`,
  `text_encoder_2...`; any text-encoder weight `<k>`: `text_encoders.<k>`;
- T5 next to CLIP-L only (FLUX): `lora_te2_<path with _>` and `lora_te3_...`.
Forge (backend/patcher/lora.py over packages_3rdparty/comfyui_lora_collection/lora.py): the same
denoiser names (FLUX's included) and CLIP names, without ComfyUI's generic `text_encoders.<k>`;
T5: `lora_te1_`/`lora_te2_`/`lora_te3_`.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import train_config

from modules.adapters.adapter_set import build_adapter_set
from modules.adapters.formats.files import file_state, load_adapter_file
from modules.config.train_config import AdapterConfig

CLIP_LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
TENSORS = re.compile(r"\.(lora_down\.weight|lora_up\.weight|lora_A\.weight|lora_B\.weight|lora_magnitude_vector|alpha"
                     r"|hada_\w+|lokr_\w+|oft_blocks|dora_scale)$")


def _flux_original_keys(transformer) -> list[str]:
    """BFL's FLUX.1 transformer weights (what ComfyUI's Flux model holds), by BFL's own names."""
    keys = ["img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "vector_in.in_layer",
            "vector_in.out_layer", "final_layer.linear", "final_layer.adaLN_modulation.1"]
    if transformer.config.guidance_embeds:
        keys += ["guidance_in.in_layer", "guidance_in.out_layer"]
    for i in range(len(transformer.transformer_blocks)):
        keys += [f"double_blocks.{i}.{side}_{layer}" for side in ("img", "txt")
                 for layer in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2", "mod.lin")]
    for i in range(len(transformer.single_transformer_blocks)):
        keys += [f"single_blocks.{i}.{layer}" for layer in ("linear1", "linear2", "modulation.lin")]
    return keys


def _clip_keys(encoder, clip: str) -> list[str]:
    """ComfyUI's CLIP weights: a transformers CLIPTextModel's state dict (`text_model.` first)
    under `<clip>.transformer.`."""
    keys = [k.removesuffix(".weight") for k in encoder.state_dict() if k.endswith(".weight")]
    return [f"{clip}.transformer.{k if k.startswith('text_model.') else 'text_model.' + k}" for k in keys]


def comfyui_map(family) -> set[str]:
    stems = set()
    if family.name == "flux":
        denoiser = _flux_original_keys(family.transformer)
        for name, module in family.transformer.named_modules():
            if isinstance(module, torch.nn.Linear):
                stems |= {f"transformer.{name}", f"lycoris_{name.replace('.', '_')}",
                          f"lora_transformer_{name.replace('.', '_')}"}
    else:
        from modules.model.components.ldm_unet_keys import ldm_unet_module_name  # checked against diffusers elsewhere

        to_ldm = family.comfy_module_name if family.name == "sdxl" else (
            lambda part, name: "diffusion_model." + ldm_unet_module_name(family.unet, name))
        layers = [n for n, m in family.unet.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
        denoiser = [to_ldm("unet", n).removeprefix("diffusion_model.") for n in layers]
        stems |= {f"lora_unet_{n.replace('.', '_')}" for n in layers}  # unet_to_diffusers: diffusers names too
    stems |= {f"lora_unet_{x.replace('.', '_')}" for x in denoiser} | {f"diffusion_model.{x}" for x in denoiser}
    stems |= _clip_stems(family, generic=True)
    if family.name == "flux":
        stems |= _t5_stems(family, ("te2", "te3"))
    return stems


def forge_map(family) -> set[str]:
    stems = {s for s in comfyui_map(family) if not s.startswith("text_encoders.")}
    if family.name == "flux":
        stems |= _t5_stems(family, ("te1", "te2", "te3"))
    return stems - _clip_stems(family, generic=True) | _clip_stems(family, generic=False)


def _clip_stems(family, generic: bool) -> set[str]:
    clips = {"text_encoder": "clip_l", "text_encoder_2": "clip_g"} if family.name == "sdxl" else {"text_encoder": "clip_l"}
    stems = set()
    for part, clip in clips.items():
        keys = _clip_keys(family.parts[part], clip)
        if generic:
            stems |= {f"text_encoders.{k}" for k in keys}
        for key in keys:
            match = re.fullmatch(rf"{clip}\.transformer\.text_model\.encoder\.layers\.(\d+)\.(.+)", key)
            if match and match.group(2) in CLIP_LAYERS:
                block, layer = match.groups()
                flat = f"text_model_encoder_layers_{block}_{layer.replace('.', '_')}"
                if clip == "clip_l":
                    stems |= {f"lora_te_{flat}", f"lora_te1_{flat}", f"text_encoder.text_model.encoder.layers.{block}.{layer}"}
                else:
                    stems |= {f"lora_te2_{flat}", f"text_encoder_2.text_model.encoder.layers.{block}.{layer}"}
    return stems


def _t5_stems(family, prefixes) -> set[str]:
    keys = [k.removesuffix(".weight") for k in family.parts["text_encoder_2"].state_dict() if k.endswith(".weight")]
    return {f"lora_{p}_{k.replace('.', '_')}" for p in prefixes for k in keys}


def _stems(state: dict) -> set[str]:
    return {TENSORS.sub("", k) for k in state}


@pytest.fixture(scope="module", params=["sd15", "sdxl", "flux"])
def family(request, tmp_path_factory, shape_images):
    from modules.model.registry import get_family_class

    cls = get_family_class(request.param)
    model = cls.make_tiny_model(tmp_path_factory.mktemp("models") / request.param)
    family = cls(train_config(model, shape_images, tmp_path_factory.mktemp("keys"), {"model": {"family": request.param}}))
    family.load()
    return family


def _adapters(family, **options):
    parts = [s.name for s in family.part_specs if s.adapter_prefix]
    return build_adapter_set(family, AdapterConfig(**{"rank": 2, **options}), parts, torch.device("cpu"))


@pytest.mark.parametrize("adapter", [{"type": "lora"}, {"type": "loha"}, {"type": "lokr"}],
                         ids=["lora", "loha", "lokr"])
@pytest.mark.parametrize("preset", ["attn", "attn-mlp"])
def test_every_saved_stem_is_one_comfyui_and_forge_match(family, preset, adapter):
    adapters = _adapters(family, layer_preset=preset, **adapter)
    try:
        formats = ["kohya"] + (["comfy"] if family.name != "flux" else [])
        comfyui, forge = comfyui_map(family), forge_map(family)
        for fmt in formats:
            stems = _stems(file_state(adapters, family, fmt))
            assert stems and not stems - comfyui, (fmt, sorted(stems - comfyui)[:5])
            assert not stems - forge, (fmt, sorted(stems - forge)[:5])
    finally:
        adapters.unhook()


def test_a_comfyui_layout_file_with_text_encoder_paths_still_loads(family, tmp_path):
    """ComfyUI's own text-encoder paths (`text_encoders.clip_l.transformer...`) are read, though
    "comfy" files now write kohya's names there."""
    from safetensors.torch import save_file

    if family.name == "flux":
        pytest.skip("FLUX has no comfy layout")
    adapters = _adapters(family, layer_preset="attn")
    try:
        state = file_state(adapters, family, "comfy")
        clips = {"lora_te_": "clip_l", "lora_te1_": "clip_l", "lora_te2_": "clip_g"}
        renamed = {}
        for key, tensor in state.items():
            prefix = next((p for p in clips if key.startswith(p)), None)
            if prefix:
                stem, _, suffix = key.partition(".")
                stem = stem.removeprefix(prefix).replace("text_model_encoder_layers_", "text_model.encoder.layers.")
                stem = re.sub(r"layers\.(\d+)_(self_attn|mlp)_", r"layers.\1.\2.", stem)
                key = f"text_encoders.{clips[prefix]}.transformer.{stem}.{suffix}"
            renamed[key] = tensor
        assert any(k.startswith("text_encoders.") for k in renamed)
        path = tmp_path / "comfyui.safetensors"
        save_file({k: v.contiguous() for k, v in renamed.items()}, str(path))
        load_adapter_file(path, adapters, family)
    finally:
        adapters.unhook()


def test_diffusers_format_says_which_adapters_comfyui_will_not_load(family):
    """ComfyUI maps diffusers UNet attention projections only as `.processor.to_q` and FLUX's T5
    only under lora_te2_/lora_te3_; the reproduced map agrees with what the warning names."""
    from modules.adapters.formats.files import format_warnings

    adapters = _adapters(family, layer_preset="attn-mlp")
    try:
        warnings = format_warnings("diffusers", adapters, family)
        comfyui = comfyui_map(family) | {f"unet.{s}" for s in _unet_diffusers_stems(family)}
        missing = sorted(s for s in _stems(file_state(adapters, family, "diffusers")) if s not in comfyui)
        assert format_warnings("kohya", adapters, family) == []
    finally:
        adapters.unhook()
    assert missing  # each family here has layers ComfyUI skips in diffusers files
    assert len(warnings) == 1 and warnings[0].startswith("output.format: 'diffusers': ComfyUI will not load")
    example = re.search(r"\(e\.g\. ([^)]*)\)", warnings[0]).group(1)
    assert f"{len(missing)} of these adapters" in warnings[0] and example in missing


def _unet_diffusers_stems(family) -> set[str]:
    """ComfyUI's `unet.<diffusers name>` keys, attention projections spelled `processor.to_q`."""
    if family.name == "flux":
        return set()
    out = set()
    for name, module in family.unet.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            key = name.replace(".to_", ".processor.to_")
            out.add(key[:-2] if key.endswith(".to_out.0") else key)
    return out
