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
from modules.adapters.formats.files import file_state, format_warnings, load_adapter_file
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
    from modules.config.families import get_family_class

    cls = get_family_class(request.param)
    model = cls.make_tiny_model(tmp_path_factory.mktemp("models") / request.param)
    family = cls(train_config(model, shape_images, tmp_path_factory.mktemp("keys"), {"model": {"family": request.param}}))
    family.load()
    return family


def _adapters(family, **options):
    parts = [s.name for s in family.part_specs if s.adapter_prefix]
    sized = {} if options.get("type") == "oft" else {"rank": 2}  # OFT is sized by its blocks
    return build_adapter_set(family, AdapterConfig(**{**sized, **options}), parts, torch.device("cpu"))


@pytest.mark.parametrize("adapter", [{"type": "lora"}, {"type": "loha"}, {"type": "lokr"}],
                         ids=["lora", "loha", "lokr"])
@pytest.mark.parametrize("preset", ["attn", "attn-mlp"])
def test_every_saved_stem_is_one_comfyui_and_forge_match(family, preset, adapter):
    adapters = _adapters(family, layer_preset=preset, **adapter)
    try:
        comfyui, forge = comfyui_map(family), forge_map(family)
        for fmt in ("kohya", "comfy"):  # FLUX's comfy files are its kohya ones
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
        pytest.skip("FLUX's comfy files are its kohya ones")
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

    adapters = _adapters(family, layer_preset="attn-mlp")
    try:
        warnings = [w for w in format_warnings("diffusers", adapters, family) if "ComfyUI" in w]
        comfyui = comfyui_map(family) | {f"unet.{s}" for s in _unet_diffusers_stems(family)}
        missing = sorted(s for s in _stems(file_state(adapters, family, "diffusers")) if s not in comfyui)
        assert not [w for w in format_warnings("kohya", adapters, family) if "ComfyUI" in w]
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


# --- Z-Image -----------------------------------------------------------------------------------
# ComfyUI's Z-Image model is Lumina2's NextDiT (comfy/ldm/lumina/model.py): per block one fused
# `attention.qkv` and `attention.out`, `feed_forward.w1/w2/w3`, `adaLN_modulation.0`; then
# `x_embedder`, `final_layer.linear`, `final_layer.adaLN_modulation.1`, `t_embedder.mlp.0/2`,
# `cap_embedder.1`. comfy/utils.py `z_image_to_diffusers` maps each diffusers weight onto those,
# q/k/v at row offsets 0, dim, 2*dim of qkv. comfy/lora.py `model_lora_keys_unet` keys LoRAs by
# `lora_unet_<own name with _>` and `diffusion_model.<own name>` (any model) and, for Lumina2, by
# `diffusion_model.<D>`, `transformer.<D>`, `lycoris_<D with _>` and `<D>` for each diffusers name
# D. `model_lora_keys_clip` (Comfy-Org/ComfyUI 0.3.64 and pollockjj/ComfyUI 0.8.0 + upstream of
# 2026-01-07 alike): the Qwen3 encoder's weights `qwen3_4b.transformer.model.<k>` (SD1ClipModel
# named "qwen3_4b", its SDClipModel's `transformer`, Qwen3_4B's `model`) only as
# `text_encoders.<weight>`: no `lora_te_` name for llama-style encoders. Forge (classic) has no Z-Image.


def _z_image_to_diffusers(transformer) -> dict[str, tuple[str, int | None]]:
    """diffusers module -> (ComfyUI module, row offset in it or None for the whole weight)."""
    dim, out = transformer.config.dim, {}
    for stack in ("noise_refiner", "context_refiner", "layers"):
        for i, block in enumerate(getattr(transformer, stack)):
            b = f"{stack}.{i}"
            out |= {f"{b}.attention.to_{p}": (f"{b}.attention.qkv", j * dim) for j, p in enumerate("qkv")}
            out[f"{b}.attention.to_out.0"] = (f"{b}.attention.out", None)
            out |= {f"{b}.feed_forward.{w}": (f"{b}.feed_forward.{w}", None) for w in ("w1", "w2", "w3")}
            if hasattr(block, "adaLN_modulation"):
                out[f"{b}.adaLN_modulation.0"] = (f"{b}.adaLN_modulation.0", None)
    out |= {"all_x_embedder.2-1": ("x_embedder", None), "all_final_layer.2-1.linear": ("final_layer.linear", None),
            "all_final_layer.2-1.adaLN_modulation.1": ("final_layer.adaLN_modulation.1", None),
            "t_embedder.mlp.0": ("t_embedder.mlp.0", None), "t_embedder.mlp.2": ("t_embedder.mlp.2", None),
            "cap_embedder.1": ("cap_embedder.1", None)}
    return out


def z_image_comfyui_map(family) -> dict[str, tuple[str, int | None]]:
    """LoRA key stem -> (the ComfyUI weight it patches, row offset); text encoder: -> (stem, None)."""
    to_comfy = _z_image_to_diffusers(family.transformer)
    stems = {}
    for own, _ in set(to_comfy.values()):
        stems[f"lora_unet_{own.replace('.', '_')}"] = stems[f"diffusion_model.{own}"] = (own, None)
    for name, target in to_comfy.items():
        for stem in (f"diffusion_model.{name}", f"transformer.{name}", f"lycoris_{name.replace('.', '_')}", name):
            stems[stem] = target
    for key in family.parts["text_encoder"].state_dict():
        if key.endswith(".weight"):
            k = key.removesuffix(".weight")
            stem = f"text_encoders.qwen3_4b.transformer.model.{k}"
            stems[stem] = (stem, None)
    return stems


@pytest.fixture(scope="module")
def z_image(tiny_family_model, tmp_path_factory, shape_images):
    from modules.model.z_image import ZImageFamily

    family = ZImageFamily(train_config(tiny_family_model("z_image"), shape_images, tmp_path_factory.mktemp("z"),
                                       {"model": {"family": "z_image"}}))
    family.load()
    return family


@pytest.mark.parametrize("adapter", [{"type": "lora"}, {"type": "lora", "dora": True}, {"type": "loha"},
                                     {"type": "lokr"}], ids=["lora", "dora", "loha", "lokr"])
def test_every_z_image_stem_is_one_comfyui_maps(z_image, adapter):
    comfyui = z_image_comfyui_map(z_image)
    adapters = _adapters(z_image, layer_preset="all-linear", **adapter)
    try:
        for fmt in ("kohya", "comfy"):
            stems = _stems(file_state(adapters, z_image, fmt))
            assert stems and not stems - comfyui.keys(), (fmt, sorted(stems - comfyui.keys())[:5])
            assert any(s.startswith("text_encoders.qwen3_4b.transformer.model.layers.") for s in stems)
        kohya = _stems(file_state(adapters, z_image, "kohya"))
        if adapter == {"type": "lora"}:  # ComfyUI reads `transformer.<D>` peft keys, not the Qwen3 ones
            unread = _stems(file_state(adapters, z_image, "diffusers")) - comfyui.keys()
            warned = [w for w in format_warnings("diffusers", adapters, z_image) if "ComfyUI" in w]
            assert unread and all(s.startswith("text_encoder.") for s in unread)
            assert len(warned) == 1 and f"{len(unread)} of these adapters" in warned[0]
    finally:
        adapters.unhook()
    if adapter == {"type": "lora"}:  # stacked: ComfyUI's own names, which diffusers' converter also reads
        assert "lora_unet_layers_0_attention_qkv" in kohya and "lora_unet_layers_0_attention_out" in kohya


@pytest.mark.parametrize("fmt", ["kohya", "comfy"])
def test_comfyui_applies_z_image_files_as_the_trainer_does(z_image, fmt):
    """Each LoRA patched onto ComfyUI's weight (rows at its offset) as comfy/lora.py does: the
    deltas equal the trainer's adapters' per ComfyUI weight (q/k/v stacked in qkv's row order)."""
    comfyui = z_image_comfyui_map(z_image)
    to_comfy = _z_image_to_diffusers(z_image.transformer)
    modules = dict(z_image.transformer.named_modules())
    adapters = _adapters(z_image, layer_preset="all-linear", alpha=3)
    try:
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for parameter in adapters.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
        state = file_state(adapters, z_image, fmt)
        expected: dict[str, list[torch.Tensor]] = {}
        for name, target in to_comfy.items():
            adapter = dict(adapters.modules).get(z_image.adapter_name("transformer", name))
            delta = adapter.delta_weight() if adapter else torch.zeros_like(modules[name].weight)
            expected.setdefault(target[0], []).append(delta.detach())
    finally:
        adapters.unhook()
    patched: dict[str, torch.Tensor] = {}
    for key in state:
        if not key.endswith(".lora_up.weight") or key.startswith("text_encoders."):
            continue
        stem = key.removesuffix(".lora_up.weight")
        up, down = state[key], state[f"{stem}.lora_down.weight"]
        delta = up @ down * (float(state[f"{stem}.alpha"]) / down.shape[0])
        own, offset = comfyui[stem]
        rows = sum(d.shape[0] for d in expected[own])
        weight = patched.setdefault(own, torch.zeros(rows, delta.shape[1]))
        weight[offset or 0: (offset or 0) + delta.shape[0]] += delta
    assert patched.keys() == expected.keys()
    for own, deltas in expected.items():
        assert torch.allclose(patched[own], torch.cat(deltas), atol=1e-6), own


@pytest.mark.parametrize("adapter", [{"type": "lora"}, {"type": "loha"}], ids=["lora", "loha"])
@pytest.mark.parametrize("fmt", ["kohya", "comfy"])
def test_z_image_files_load_back_into_the_same_adapters(z_image, tmp_path, fmt, adapter):
    from modules.adapters.formats.files import save_adapter_file

    adapters = _adapters(z_image, layer_preset="all-linear", **adapter)
    try:
        with torch.no_grad():
            for parameter in adapters.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(4)) * 0.1)
        state = {k: v.clone() for k, v in adapters.state_dict().items()}
        save_adapter_file(tmp_path / "z.safetensors", adapters, z_image, fmt, torch.float32, {})
    finally:
        adapters.unhook()
    again = _adapters(z_image, layer_preset="all-linear", **adapter)
    try:
        load_adapter_file(tmp_path / "z.safetensors", again, z_image)
        loaded = again.state_dict()
    finally:
        again.unhook()
    assert loaded.keys() == state.keys()
    assert all(torch.allclose(loaded[k], state[k], atol=1e-6) for k in state)


def test_old_lora_te_z_image_files_still_load(z_image, tmp_path):
    """Files written before the text encoder took ComfyUI's paths (`lora_te_layers_0_...`) load."""
    from safetensors.torch import save_file

    adapters = _adapters(z_image, layer_preset="attn")
    try:
        old = adapters.state_dict()  # adapter names: the old kohya stems
        assert any(k.startswith("lora_te_layers_") for k in old)
        save_file({k: v.contiguous() for k, v in old.items()}, str(tmp_path / "old.safetensors"))
        load_adapter_file(tmp_path / "old.safetensors", adapters, z_image)
    finally:
        adapters.unhook()


# --- FLUX.2 and Qwen-Image --------------------------------------------------------------------
# ComfyUI's FLUX.2 model is a Flux model (comfy/model_base.py `class Flux2(Flux)`) built from
# comfy/ldm/flux/model.py with `global_modulation`: its own weights are BFL's (below); the Flux
# branch of model_lora_keys_unet adds `transformer.<D>`, `lycoris_<D with _>`,
# `lora_transformer_<D with _>` for each FLUX.1 diffusers name D of comfy/utils.py
# flux_to_diffusers, and a key whose target weight the FLUX.2 model lacks patches nothing
# (ModelPatcher.add_patches skips it). Its text encoder: SD1ClipModel named "qwen3_4b"/"qwen3_8b"
# (klein) or "mistral3_24b" ([dev], comfy/text_encoders/flux.py Flux2TEModel), weights
# `<name>.transformer.model.<k>`, mapped only as `text_encoders.<weight>`. ComfyUI's Qwen-Image
# (comfy/ldm/qwen_image/model.py) has diffusers' module names; model_lora_keys_unet maps
# `lora_unet_<k with _>`, `diffusion_model.<k>` and, for QwenImage, `<k>`, `transformer.<k>`,
# `lycoris_<k with _>`; its Qwen2.5-VL encoder is "qwen25_7b".


def _flux2_original_keys(transformer) -> list[str]:
    keys = ["img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "final_layer.linear",
            "final_layer.adaLN_modulation.1", "double_stream_modulation_img.lin", "double_stream_modulation_txt.lin",
            "single_stream_modulation.lin"]
    if transformer.config.guidance_embeds:
        keys += ["guidance_in.in_layer", "guidance_in.out_layer"]
    for i in range(len(transformer.transformer_blocks)):
        keys += [f"double_blocks.{i}.{side}_{layer}" for side in ("img", "txt")
                 for layer in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")]
    for i in range(len(transformer.single_transformer_blocks)):
        keys += [f"single_blocks.{i}.{layer}" for layer in ("linear1", "linear2")]
    return keys


def _flux1_diffusers_names(double: int, single: int) -> dict[str, str]:
    """comfy/utils.py flux_to_diffusers: FLUX.1 diffusers module -> the original weight it patches."""
    out = {"proj_out": "final_layer.linear", "x_embedder": "img_in", "context_embedder": "txt_in",
           "norm_out.linear": "final_layer.adaLN_modulation.1"}
    for source, target in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"),
                           ("guidance_in", "guidance_embedder")):
        out |= {f"time_text_embed.{target}.linear_1": f"{source}.in_layer",
                f"time_text_embed.{target}.linear_2": f"{source}.out_layer"}
    for i in range(double):
        b, o = f"transformer_blocks.{i}", f"double_blocks.{i}"
        out |= {f"{b}.attn.{p}": f"{o}.img_attn.qkv" for p in ("to_q", "to_k", "to_v")}
        out |= {f"{b}.attn.{p}": f"{o}.txt_attn.qkv" for p in ("add_q_proj", "add_k_proj", "add_v_proj")}
        out |= {f"{b}.attn.to_out.0": f"{o}.img_attn.proj", f"{b}.attn.to_add_out": f"{o}.txt_attn.proj",
                f"{b}.norm1.linear": f"{o}.img_mod.lin", f"{b}.norm1_context.linear": f"{o}.txt_mod.lin",
                f"{b}.ff.net.0.proj": f"{o}.img_mlp.0", f"{b}.ff.net.2": f"{o}.img_mlp.2",
                f"{b}.ff_context.net.0.proj": f"{o}.txt_mlp.0", f"{b}.ff_context.net.2": f"{o}.txt_mlp.2"}
    for i in range(single):
        b, o = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        out |= {f"{b}.attn.{p}": f"{o}.linear1" for p in ("to_q", "to_k", "to_v")}
        out |= {f"{b}.proj_mlp": f"{o}.linear1", f"{b}.norm.linear": f"{o}.modulation.lin", f"{b}.proj_out": f"{o}.linear2"}
    return out


def _text_encoder_stems(encoder, name: str) -> set[str]:
    return {f"text_encoders.{name}.transformer.model.{k.removesuffix('.weight')}"
            for k in encoder.state_dict() if k.endswith(".weight")}


def flux2_comfyui_map(family) -> set[str]:
    transformer = family.transformer
    own = _flux2_original_keys(transformer)
    stems = {f"lora_unet_{k.replace('.', '_')}" for k in own} | {f"diffusion_model.{k}" for k in own}
    for name, target in _flux1_diffusers_names(len(transformer.transformer_blocks),
                                               len(transformer.single_transformer_blocks)).items():
        if target in own:
            stems |= {f"transformer.{name}", f"lycoris_{name.replace('.', '_')}",
                      f"lora_transformer_{name.replace('.', '_')}"}
    encoder = family.parts["text_encoder"]
    width = encoder.config.hidden_size
    name = "mistral3_24b" if family.is_dev else ("qwen3_8b" if width == 4096 else "qwen3_4b")
    return stems | _text_encoder_stems(encoder, name)


def qwen_image_comfyui_map(family) -> set[str]:
    stems = set()
    for key in family.transformer.state_dict():
        if key.endswith(".weight"):
            k = key.removesuffix(".weight")
            stems |= {f"lora_unet_{k.replace('.', '_')}", f"diffusion_model.{k}", k, f"transformer.{k}",
                      f"lycoris_{k.replace('.', '_')}"}
    return stems | _text_encoder_stems(family.parts["text_encoder"], "qwen25_7b")


def _load_family(name, tiny_family_model, tmp_path_factory, shape_images, **options):
    from modules.config.families import get_family_class

    cls = get_family_class(name)
    family = cls(train_config(tiny_family_model(name, **options), shape_images, tmp_path_factory.mktemp(name),
                              {"model": {"family": name}}))
    family.load()
    return family


@pytest.fixture(scope="module", params=[("flux2", {}), ("flux2", {"variant": "dev"}), ("qwen_image", {})],
                ids=["flux2-klein", "flux2-dev", "qwen_image"])
def llm_family(request, tiny_family_model, tmp_path_factory, shape_images):
    name, options = request.param
    return _load_family(name, tiny_family_model, tmp_path_factory, shape_images, **options)


ALGORITHMS = [{"type": "lora"}, {"type": "lora", "dora": True}, {"type": "loha"}, {"type": "lokr"}, {"type": "oft"}]


@pytest.mark.parametrize("adapter", ALGORITHMS, ids=["lora", "dora", "loha", "lokr", "oft"])
def test_every_flux2_and_qwen_image_stem_is_one_comfyui_maps(llm_family, adapter):
    """Every adapter of every algorithm, transformer and text encoder, is a key ComfyUI maps to a
    weight its model has: no "lora key not loaded", none patching nothing."""
    comfyui = (flux2_comfyui_map if llm_family.name == "flux2" else qwen_image_comfyui_map)(llm_family)
    adapters = _adapters(llm_family, layer_preset="all-linear", **adapter)
    try:
        for fmt in ("kohya", "comfy"):
            stems = _stems(file_state(adapters, llm_family, fmt))
            assert not stems - comfyui, (fmt, sorted(stems - comfyui)[:5])
            encoder = [s for s in stems if s.startswith("text_encoders.")]
            assert encoder and not [s for s in stems if s.startswith("lora_te_")]
    finally:
        adapters.unhook()


def test_flux2_unstacked_attention_is_read_as_rows_of_the_fused_qkv(llm_family):
    """LoHa on FLUX.2's q/k/v: `lora_transformer_transformer_blocks_0_attn_to_q` (ComfyUI's FLUX
    diffusers map), not the `lora_unet_` spelling it has no name for; the final adaLN, whose
    original swaps its halves, under its diffusers name (ComfyUI swaps it)."""
    if llm_family.name != "flux2":
        pytest.skip("FLUX.2 only")
    adapters = _adapters(llm_family, layer_preset="all-linear", type="loha")
    try:
        stems = _stems(file_state(adapters, llm_family, "kohya"))
    finally:
        adapters.unhook()
    assert "lora_transformer_transformer_blocks_0_attn_to_q" in stems
    assert "lora_transformer_norm_out_linear" in stems and "lora_unet_final_layer_adaLN_modulation_1" not in stems
    assert "lora_unet_double_blocks_0_img_attn_proj" in stems  # a whole original layer keeps its name


@pytest.mark.parametrize("adapter", [{"type": "loha"}, {"type": "lora", "dora": True}], ids=["loha", "dora"])
def test_old_flux2_and_qwen_image_files_still_load(llm_family, tmp_path, adapter):
    """Files of the old names (`lora_unet_transformer_blocks_0_attn_to_q`, `lora_te_layers_0_...`:
    the adapter names) and of the new ones load into the same adapters."""
    from safetensors.torch import save_file

    from modules.adapters.formats.files import save_adapter_file

    adapters = _adapters(llm_family, layer_preset="all-linear", **adapter)
    try:
        with torch.no_grad():
            for parameter in adapters.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
        state = {k: v.clone() for k, v in adapters.state_dict().items()}
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "old.safetensors"))
        save_adapter_file(tmp_path / "new.safetensors", adapters, llm_family, "kohya", torch.float32, {})
    finally:
        adapters.unhook()
    for name in ("old", "new"):
        again = _adapters(llm_family, layer_preset="all-linear", **adapter)
        try:
            load_adapter_file(tmp_path / f"{name}.safetensors", again, llm_family)
            loaded = again.state_dict()
        finally:
            again.unhook()
        assert loaded.keys() == state.keys()
        assert all(torch.allclose(loaded[k], state[k], atol=1e-6) for k in state), name


def test_flux2_diffusers_files_warn_of_what_comfyui_will_not_load(llm_family):
    """A FLUX.2 diffusers file's transformer keys go through ComfyUI's FLUX.1 diffusers names: the
    warning counts exactly the adapters the reproduced map lacks (feed-forward, single blocks,
    modulations, time/guidance embedders)."""
    if llm_family.name != "flux2":
        pytest.skip("FLUX.2 only")
    comfyui = flux2_comfyui_map(llm_family)
    adapters = _adapters(llm_family, layer_preset="all-linear")
    try:
        unread = sorted(s for s in _stems(file_state(adapters, llm_family, "diffusers"))
                        if s.startswith("transformer.") and s not in comfyui)
        warned = [w for w in format_warnings("diffusers", adapters, llm_family)
                  if "ComfyUI" in w and "FLUX diffusers-name map" in w]
        assert not [w for w in format_warnings("kohya", adapters, llm_family) if "ComfyUI" in w]
    finally:
        adapters.unhook()
    assert unread and len(warned) == 1 and f"{len(unread)} of these adapters" in warned[0]
    assert re.search(r"\(e\.g\. ([^)]*)\)", warned[0]).group(1) in unread


def test_sd3_diffusers_files_warn_that_comfyui_drops_the_clip_text_projections(tiny_family_model, tmp_path_factory,
                                                                               shape_images):
    """ComfyUI maps a diffusers file's CLIP keys only as `text_encoder(_2).text_model.encoder.layers.
    <b>.<c>` (model_lora_keys_clip); SD3's all-linear text_projection adapters are not among them."""
    family = _load_family("sd3", tiny_family_model, tmp_path_factory, shape_images)
    adapters = _adapters(family, layer_preset="all-linear")
    try:
        read = {f"{part}.text_model.encoder.layers.{b}.{c}" for part in ("text_encoder", "text_encoder_2")
                for b in range(32) for c in CLIP_LAYERS}
        unread = sorted(s for s in _stems(file_state(adapters, family, "diffusers"))
                        if s.startswith(("text_encoder.", "text_encoder_2.")) and s not in read)
        warned = [w for w in format_warnings("diffusers", adapters, family) if "text_projection" in w]
    finally:
        adapters.unhook()
    assert unread == ["text_encoder.text_projection", "text_encoder_2.text_projection"]
    assert len(warned) == 1 and "2 of these adapters" in warned[0]


SD_SCRIPTS_TARGETS = ("Transformer2DModel", "ResnetBlock2D", "Downsample2D", "Upsample2D", "CLIPAttention",
                      "CLIPSdpaAttention", "CLIPMLP")


def test_kohya_files_warn_of_what_sd_scripts_will_not_load(family):
    """kohya's sd-scripts (networks/lora.py) adapts only the layers inside its target module
    classes; a `layer_preset: all` kohya file's other adapters (SD1.5: conv_in, conv_out, both
    time_embedding layers) it ignores, and the run says how many."""
    if family.name == "flux":
        pytest.skip("UNet families")
    adapters = _adapters(family, layer_preset="all")
    try:
        inside = set()
        for part in adapters.part_of.values():
            for name, module in family.parts[part].named_modules():
                if type(module).__name__ in SD_SCRIPTS_TARGETS:
                    inside |= {f"{part}.{name}.{n}" for n, _ in module.named_modules() if n}
        outside = sorted(f"{adapters.part_of[n]}.{adapters.module_name_of[n]}" for n in adapters.modules
                         if f"{adapters.part_of[n]}.{adapters.module_name_of[n]}" not in inside)
        warned = [w for w in format_warnings("kohya", adapters, family) if "sd-scripts" in w]
        assert not [w for w in format_warnings("comfy", adapters, family) if "sd-scripts" in w]
    finally:
        adapters.unhook()
    assert {"unet.conv_in", "unet.conv_out", "unet.time_embedding.linear_1", "unet.time_embedding.linear_2"} <= set(outside)
    counted = sum(int(re.search(r"load (\d+) of these", w).group(1)) for w in warned)
    assert counted == len(outside), (outside, warned)
