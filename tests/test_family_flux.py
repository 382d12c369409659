"""FLUX.1 on a tiny offline model (dev: guidance embedding): training learns under the flow
target, and the files it writes load in `FluxPipeline.load_lora_weights` and compute what the
trainer's hooked model computes."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import (
    MODES,
    blocks_run_in_listed_order,
    initializes_and_steps,
    loads_beside_a_skeleton_denoiser,
    offloaded_training_matches,
    perturbed_adapters,
)

from modules.adapters.formats.files import save_adapter_file
from modules.config.loading import build_config
from modules.config.presets import list_presets, load_preset_overlay
from modules.trainer.generic_trainer import GenericTrainer


@pytest.fixture(scope="session")
def tiny_flux(tiny_family_model):
    return tiny_family_model("flux")  # the session's, shared with the preset and guard tests


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_flux, shape_images):
    from modules.model.flux import FluxFamily

    family = FluxFamily(train_config(tiny_flux, shape_images, tmp_path_factory.mktemp("flux"),
                                     {"model": {"family": "flux"}}))
    family.load()
    return family


def test_flux_trains_a_lora_and_the_loss_falls(tmp_path, tiny_flux, one_image):
    config = train_config(tiny_flux, one_image, tmp_path, {
        "model": {"family": "flux", "parts": {"transformer": {"gradient_checkpointing": True}}},
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 30, "batch_size": 1},
        "optimizer": {"lr": 3e-3},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter learned
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert after < before * 0.8, (before, after)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        # sd-scripts' names on the original layers (formats/fused.py), what diffusers converts
        assert any(k.startswith("lora_unet_single_blocks_0_linear1.") for k in file.keys())  # noqa: SIM118 (safe_open is no dict)
        assert file.metadata()["ss_base_model_version"] == "flux1"


def test_flux_predict_packs_and_targets_the_flow(family):
    latents = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(0))
    text = family.encode_text(family.tokenize(["a", "b"]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        prediction, target, *_ = family.predict(latents, text, generator)
    assert prediction.shape == latents.shape
    replay = torch.Generator().manual_seed(3)
    noise = torch.randn(latents.shape, generator=replay)
    assert torch.allclose(target, noise - latents)


def _outputs(family, transformer, clip):
    tokens = family.tokenize(["a red circle on a blue background"])
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pooled = clip(tokens["input_ids"]).pooler_output
        hidden = family.parts["text_encoder_2"](tokens["input_ids_2"])[0]
        original = family.parts["transformer"]
        family.parts["transformer"] = transformer
        try:
            sample = family.denoise(latents, torch.tensor([0.5]), {"pooled": pooled, "hidden_states": hidden})
        finally:
            family.parts["transformer"] = original
    return pooled, sample


@pytest.mark.parametrize("fmt, preset", [("diffusers", "all-linear")])
def test_load_lora_weights_matches_the_hooked_model(family, tiny_flux, tmp_path, fmt, preset):
    """The diffusers layout holds every Linear layer (kohya files: test_flux_kohya_files.py; the
    tiny model's single block is narrower than diffusers' kohya converter allows)."""
    from diffusers import FluxPipeline

    adapters = perturbed_adapters(family, ["transformer", "text_encoder"], layer_preset=preset)
    try:
        path = tmp_path / f"flux-{fmt}.safetensors"
        save_adapter_file(path, adapters, family, fmt, torch.float32, {})
        ours = _outputs(family, family.transformer, family.parts["text_encoder"])
        pipe = FluxPipeline.from_pretrained(str(tiny_flux), local_files_only=True)
        pipe.load_lora_weights(str(path))
        theirs = _outputs(family, pipe.transformer, pipe.text_encoder)
        adapters.unhook()
        plain = _outputs(family, family.transformer, family.parts["text_encoder"])
        for mine, other, base in zip(ours, theirs, plain):
            assert (mine - base).abs().max() > 1e-3
            assert (mine - other).abs().max() < 1e-5
    finally:
        adapters.unhook()


def test_a_comfy_flux_file_is_the_kohya_file(family):
    """ComfyUI reads sd-scripts' FLUX names for every layer (test_consumer_keys.py), so `comfy`
    writes them rather than a second layout."""
    from modules.adapters.formats.files import file_state

    adapters = perturbed_adapters(family, ["transformer", "text_encoder", "text_encoder_2"], layer_preset="attn")
    try:
        kohya, comfy = file_state(adapters, family, "kohya"), file_state(adapters, family, "comfy")
    finally:
        adapters.unhook()
    assert any(k.startswith("lora_unet_double_blocks_0_img_attn_qkv.") for k in comfy)
    assert comfy.keys() == kohya.keys() and all(torch.equal(comfy[k], kohya[k]) for k in kohya)


def test_checkpoint_blocks_are_the_transformer_blocks_in_order(family):
    blocks = family.checkpoint_blocks("transformer")
    transformer = family.transformer
    assert blocks == [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    assert len(family.checkpoint_blocks("text_encoder_2")) == 2


def test_flux_presets_are_listed_and_valid():
    names = [p.name for p in list_presets() if p.family == "flux"]
    assert "Flux LoRA 16GB" in names
    for name in names:
        config = build_config([load_preset_overlay(name)])
        assert config.model.family == "flux"
        assert config.model.parts["transformer"].gradient_checkpointing


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("mode", MODES)
def test_each_base_precision_with_lora_and_dora_initializes_and_steps(tmp_path, tiny_flux, one_image, mode, dora):
    initializes_and_steps(tiny_flux, one_image, tmp_path, "flux", "transformer", mode, dora)


# --- single files ---------------------------------------------------------------------------


def _transformer_to_bfl(state: dict) -> dict:
    """diffusers FluxTransformer2DModel keys -> the original (BFL) layout, fusing q/k/v."""
    import re

    names = [("x_embedder", "img_in"), ("context_embedder", "txt_in"), ("proj_out", "final_layer.linear")]
    for target, source in (("timestep_embedder", "time_in"), ("text_embedder", "vector_in"),
                           ("guidance_embedder", "guidance_in")):
        names += [(f"time_text_embed.{target}.linear_1", f"{source}.in_layer"),
                  (f"time_text_embed.{target}.linear_2", f"{source}.out_layer")]
    double = {"norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin", "attn.norm_q": "img_attn.norm.query_norm",
              "attn.norm_k": "img_attn.norm.key_norm", "attn.norm_added_q": "txt_attn.norm.query_norm",
              "attn.norm_added_k": "txt_attn.norm.key_norm", "attn.to_out.0": "img_attn.proj",
              "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
              "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2"}
    single = {"norm.linear": "modulation.lin", "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm",
              "proj_out": "linear2"}
    out = {}
    for key, tensor in state.items():
        module, _, attr = key.rpartition(".")
        match = re.match(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.*)$", module)
        if module == "norm_out.linear":
            scale, shift = tensor.chunk(2, dim=0)
            out[f"final_layer.adaLN_modulation.1.{attr}"] = torch.cat([shift, scale])
        elif match:
            kind, index, rest = match.groups()
            prefix = f"{'double' if kind == 'transformer_blocks' else 'single'}_blocks.{index}"
            table = double if kind == "transformer_blocks" else single
            if rest in ("attn.to_q", "attn.add_q_proj"):
                names_qkv = ("to_q", "to_k", "to_v") if rest == "attn.to_q" else ("add_q_proj", "add_k_proj", "add_v_proj")
                pieces = [state[f"{kind}.{index}.attn.{n}.{attr}"] for n in names_qkv]
                if kind == "single_transformer_blocks":
                    out[f"{prefix}.linear1.{attr}"] = torch.cat([*pieces, state[f"{kind}.{index}.proj_mlp.{attr}"]])
                else:
                    out[f"{prefix}.{'img' if rest == 'attn.to_q' else 'txt'}_attn.qkv.{attr}"] = torch.cat(pieces)
            elif rest in table:
                new = table[rest]
                out[f"{prefix}.{new}.{'scale' if 'norm.' in new and 'norm' in new.split('.')[-1] else attr}"] = tensor
        else:
            out[f"{dict(names)[module]}.{attr}"] = tensor
    return out


def test_a_comfyui_all_in_one_flux_file_loads_the_same_tensors(tmp_path, tiny_flux, shape_images, family):
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file, save_file
    from test_single_file import _vae_to_ldm

    from modules.model.flux import FluxFamily

    def folder_state(part):
        return load_file(str(next((tiny_flux / part).glob("*.safetensors"))))

    tensors = {"model.diffusion_model." + k: v for k, v in _transformer_to_bfl(folder_state("transformer")).items()}
    vae = AutoencoderKL.from_pretrained(str(tiny_flux / "vae"))
    tensors.update({"vae." + k.removeprefix("first_stage_model."): v
                    for k, v in _vae_to_ldm(vae, folder_state("vae")).items()})
    tensors.update({"text_encoders.clip_l.transformer.text_model." + k: v for k, v in folder_state("text_encoder").items()})
    tensors.update({"text_encoders.t5xxl.transformer." + k: v for k, v in folder_state("text_encoder_2").items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "flux.safetensors"))
    from_file = FluxFamily(train_config(tmp_path / "flux.safetensors", shape_images, tmp_path,
                                        {"model": {"family": "flux"}}))
    from_file.model_configs_dir = tiny_flux
    from_file.load()
    for part, module in family.parts.items():
        ours, theirs = from_file.parts[part].state_dict(), module.state_dict()
        assert set(ours) == set(theirs), part
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), part


def test_the_flux_converter_agrees_with_diffusers_on_the_released_shapes():
    """diffusers' converter fixes the widths at FLUX.1's 3072, so the tiny model cannot use it; ours
    reads them from the tensors. On the released architecture (meta tensors, plus real int8 ones
    for each kind of computed tensor) both give the same keys, shapes and values."""
    from pathlib import Path

    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_flux_transformer_checkpoint_to_diffusers,
    )

    from modules.model.flux import flux_transformer_to_diffusers

    folder = Path(__file__).resolve().parents[1] / "resources" / "model_configs" / "flux" / "transformer"
    with init_empty_weights():
        model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(str(folder)))
    original = _transformer_to_bfl(model.state_dict())
    generator = torch.Generator().manual_seed(0)
    for key in ("double_blocks.0.img_attn.qkv.weight", "double_blocks.0.txt_attn.qkv.bias",
                "single_blocks.0.linear1.weight", "single_blocks.0.linear1.bias", "final_layer.adaLN_modulation.1.weight"):
        original[key] = torch.randint(-100, 100, original[key].shape, generator=generator, dtype=torch.int8)
    ours = flux_transformer_to_diffusers(dict(original))
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(original))
    assert set(ours) == set(theirs) == set(model.state_dict())
    for key in ours:
        assert ours[key].shape == theirs[key].shape, key
        if not ours[key].is_meta:
            assert torch.equal(ours[key], theirs[key]), key
    assert sum(not t.is_meta for t in ours.values()) >= 12


def test_sample_draws_an_image_from_the_live_modules(family):
    from modules.config.train_config import SamplePromptConfig

    prompt = SamplePromptConfig(prompt="a red circle", negative_prompt="blurry", steps=2, cfg=2.0, width=64,
                                height=64, seed=3)
    image = family.sample(prompt, torch.device("cpu"))
    assert image.size == (64, 64)
    assert image.getextrema() != ((0, 0), (0, 0), (0, 0))


def test_offloading_half_the_transformer_trains_the_same_adapter(fake_device, tmp_path, tiny_flux, one_image):
    offloaded_training_matches(tiny_flux, one_image, tmp_path, "flux", "transformer", fake_device)


def test_the_transformer_runs_its_blocks_in_the_listed_order(family):
    latents = torch.randn(1, 16, 8, 8)
    text = family.encode_text(family.tokenize(["a"]))
    blocks_run_in_listed_order(family, "transformer", lambda: family.denoise(latents, torch.tensor([0.5]), text))


@pytest.mark.parametrize("fmt", ["kohya", "diffusers"])
def test_the_run_says_diffusers_loads_no_t5_adapters(family, tmp_path, fmt):
    from diffusers import FluxPipeline

    from modules.adapters.formats.files import format_warnings

    # with CLIP's adapters: a file of T5 adapters alone diffusers refuses outright ("Invalid LoRA checkpoint")
    adapters = perturbed_adapters(family, ["text_encoder", "text_encoder_2"], layer_preset="attn")
    try:
        path = tmp_path / f"t5-{fmt}.safetensors"
        save_adapter_file(path, adapters, family, fmt, torch.float32, {})
        warnings = format_warnings(fmt, adapters, family)
        count = sum(part == "text_encoder_2" for part in adapters.part_of.values())
    finally:
        adapters.unhook()
    pipe = FluxPipeline(scheduler=None, vae=None, text_encoder=family.parts["text_encoder"], tokenizer=None,
                        text_encoder_2=family.parts["text_encoder_2"], tokenizer_2=None, transformer=family.transformer)
    pipe.load_lora_weights(str(path))
    try:
        loaded = {part: [n for n, m in family.parts[part].named_modules() if hasattr(m, "lora_A")]
                  for part in ("text_encoder", "text_encoder_2")}
    finally:
        pipe.unload_lora_weights()
    assert loaded["text_encoder"] and loaded["text_encoder_2"] == []
    said = [w for w in warnings if "diffusers' load_lora_weights" in w]
    assert len(said) == 1 and f"will not load {count} of these adapters" in said[0]
    assert "model.parts.text_encoder_2.train" in said[0] and "FluxPipeline.load_lora_weights" in said[0]


def test_a_skeleton_transformer_leaves_the_load_unchanged(family):
    loads_beside_a_skeleton_denoiser(family)  # what `launch.py cache` loads
