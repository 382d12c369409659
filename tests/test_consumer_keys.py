"""Every key stem a saved file holds is one ComfyUI and Forge match, by their public loaders' key
maps as modules/saving/consumers/ keeps them (comfyui.py, forge.py: facts from their sources,
the versions they reflect named there), so renaming a stem breaks a test."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import train_config

from modules.adapters.adapter_set import build_adapter_set
from modules.adapters.formats.files import file_state, format_warnings, load_adapter_file
from modules.config.train_config import AdapterConfig
from modules.saving.consumers import comfyui, forge
from modules.saving.consumers.check import check
from modules.saving.consumers.check import module_stems as _stems

CLIP_LAYERS = comfyui.CLIP_LAYERS
comfyui_map, forge_map = comfyui.sd_flux_stems, forge.sd_flux_stems
_z_image_to_diffusers, z_image_comfyui_map = comfyui.z_image_to_diffusers, comfyui.z_image_map
flux2_comfyui_map, qwen_image_comfyui_map = comfyui.flux2_stems, comfyui.qwen_image_stems


def _unet_diffusers_stems(family) -> set[str]:
    return set() if family.name == "flux" else comfyui.unet_diffusers_stems(family)


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
        comfy_stems, forge_stems = comfyui_map(family), forge_map(family)
        for fmt in ("kohya", "comfy"):  # FLUX's comfy files are its kohya ones
            stems = _stems(file_state(adapters, family, fmt))
            assert stems and not stems - comfy_stems, (fmt, sorted(stems - comfy_stems)[:5])
            assert not stems - forge_stems, (fmt, sorted(stems - forge_stems)[:5])
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


def test_the_save_check_counts_what_each_consumer_applies_and_drops(family, tmp_path):
    """check_file reads a saved file's keys: a kohya file is applied whole by both; a diffusers
    file's modules ComfyUI lacks (the ones the format warning counts) are dropped, named."""
    from modules.adapters.formats.files import save_adapter_file
    from modules.saving.consumers.check import check_file, summary, target_drops

    adapters = _adapters(family, layer_preset="attn-mlp")
    try:
        save_adapter_file(tmp_path / "k.safetensors", adapters, family, "kohya", torch.float32, {})
        save_adapter_file(tmp_path / "d.safetensors", adapters, family, "diffusers", torch.float32, {})
        modules = len(_stems(file_state(adapters, family, "kohya")))
        unread = _stems(file_state(adapters, family, "diffusers")) - comfyui.stems(family)
    finally:
        adapters.unhook()
    kohya, diffusers = check_file(tmp_path / "k.safetensors", family), check_file(tmp_path / "d.safetensors", family)
    assert kohya == {name: {"applied": modules, "total": modules, "dropped": []} for name in ("ComfyUI", "Forge")}
    assert summary("ComfyUI", kohya["ComfyUI"]) == f"ComfyUI: {modules}/{modules} modules applied"
    assert not target_drops("kohya", kohya)
    assert unread and diffusers["ComfyUI"]["dropped"] == sorted(unread)
    assert diffusers["ComfyUI"]["applied"] == diffusers["ComfyUI"]["total"] - len(unread)
    line = summary("ComfyUI", diffusers["ComfyUI"])
    assert f"drops {len(unread)}: {sorted(unread)[0]}" in line


# --- Z-Image ---


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


# --- FLUX.2 and Qwen-Image ---


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


@pytest.fixture(scope="module", params=["chroma", "sd3"])
def dit_family(request, tiny_family_model, tmp_path_factory, shape_images):
    return _load_family(request.param, tiny_family_model, tmp_path_factory, shape_images)


@pytest.mark.parametrize("adapter", ALGORITHMS, ids=["lora", "dora", "loha", "lokr", "oft"])
def test_every_chroma_and_sd3_stem_is_one_comfyui_maps(dit_family, adapter):
    """Chroma (ComfyUI's Flux subclass) and SD3 (its MMDiT): every adapter of every algorithm on
    every linear layer, transformer and text encoders, in kohya and comfy files, is a key ComfyUI
    maps to a weight its model has; a diffusers file's unread keys are exactly those the run warns
    of (T5, Chroma's distilled guidance layer, SD3's CLIP text projections)."""
    known = comfyui.stems(dit_family)
    adapters = _adapters(dit_family, layer_preset="all-linear", **adapter)
    try:
        for fmt in ("kohya", "comfy"):
            stems = _stems(file_state(adapters, dit_family, fmt))
            assert not stems - known, (fmt, sorted(stems - known)[:5])
            assert any(s.startswith("lora_te") for s in stems)  # the text encoders are in the file
        if adapter == {"type": "lora"}:  # diffusers/peft holds it (DoRA on this axis it cannot)
            unread = _stems(file_state(adapters, dit_family, "diffusers")) - known
            warned = [w for w in format_warnings("diffusers", adapters, dit_family) if "ComfyUI will not load" in w]
            counts = [int(re.search(r"load (\d+) of these", w).group(1)) for w in warned]
            assert unread and sum(counts) == len(unread), (sorted(unread)[:5], warned)
    finally:
        adapters.unhook()


@pytest.mark.parametrize("adapter", [{"type": "lora"}, {"type": "loha"}], ids=["lora", "loha"])
def test_forge_loads_chroma_and_sd3_kohya_files_by_their_own_weight_names(dit_family, adapter):
    """Forge (dfdcbab6) maps Chroma's and SD3's denoiser only by the weights' own names: a kohya LoRA,
    stacked onto those layers, loads whole (text encoders too); a LoHa's per-module q/k/v keys
    (`lora_transformer_...`) are the only ones it drops, and the save check says so."""
    known = forge.stems(dit_family)
    adapters = _adapters(dit_family, layer_preset="all-linear", **adapter)
    try:
        stems = _stems(file_state(adapters, dit_family, "kohya"))
    finally:
        adapters.unhook()
    dropped = stems - known
    assert any(s.startswith("lora_te") for s in stems - dropped)  # the text encoders load
    if adapter["type"] == "lora":
        assert not dropped, sorted(dropped)[:5]
    else:
        assert dropped and all(s.startswith("lora_transformer_") for s in dropped), sorted(dropped)[:5]
        assert check(stems, dit_family)["Forge"]["dropped"] == sorted(dropped)
