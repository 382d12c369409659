"""Z-Image on a tiny offline model (Qwen3 text encoder, offline byte-level tokenizer with a chat
template): training learns under the flow target, the files it writes load in
`ZImagePipeline.load_lora_weights` and match the hooked model, and an original-layout
transformer file (fused q/k/v) loads to the same tensors as the diffusers folder."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import (
    MODES,
    blocks_run_in_listed_order,
    initializes_and_steps,
    loads_beside_a_skeleton_denoiser,
    perturbed_adapters,
)
from safetensors.torch import load_file, save_file

from modules.adapters.formats.files import format_warnings, save_adapter_file
from modules.config.loading import build_config
from modules.config.presets import list_presets, load_preset_overlay
from modules.trainer.generic_trainer import GenericTrainer


@pytest.fixture(scope="session")
def tiny_z_image(tiny_family_model):
    return tiny_family_model("z_image")  # the session's, shared with the preset and guard tests


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_z_image, shape_images):
    from modules.model.z_image import ZImageFamily

    family = ZImageFamily(train_config(tiny_z_image, shape_images, tmp_path_factory.mktemp("z"),
                                       {"model": {"family": "z_image"}}))
    family.load()
    return family


def test_z_image_trains_a_lora_and_the_loss_falls(tmp_path, tiny_z_image, one_image):
    config = train_config(tiny_z_image, one_image, tmp_path, {
        "model": {"family": "z_image", "parts": {"transformer": {"gradient_checkpointing": True}}},
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
        # LoRA on ComfyUI's fused attention layer (test_consumer_keys.py has ComfyUI's names)
        assert any(k.startswith("lora_unet_layers_0_attention_qkv.") for k in file.keys())  # noqa: SIM118 (safe_open is no dict)


def test_captions_of_different_lengths_batch_through_the_mask(family):
    tokens = family.tokenize(["a", "a much longer caption with many more tokens"])
    assert tokens["attention_mask"][0].sum() < tokens["attention_mask"][1].sum()
    text = family.encode_text(tokens)
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prediction, target, *_ = family.predict(latents, text, torch.Generator().manual_seed(1))
    assert prediction.shape == target.shape == latents.shape
    # the padded positions do not reach the transformer: the first caption alone gives the same
    with torch.no_grad():
        alone = family.denoise(latents[:1], torch.tensor([0.5]),
                               family.encode_text(family.tokenize(["a"])))
        batched = family.denoise(latents, torch.tensor([0.5, 0.5]), text)[:1]
    assert torch.allclose(alone, batched, atol=1e-5)


def _output(family, transformer):
    text = family.encode_text(family.tokenize(["a red circle on a blue background"]))
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    original = family.parts["transformer"]
    family.parts["transformer"] = transformer
    try:
        with torch.no_grad():
            return family.denoise(latents, torch.tensor([0.5]), text)
    finally:
        family.parts["transformer"] = original


@pytest.mark.parametrize("fmt, preset", [("kohya", "attn-mlp"), ("comfy", "all-linear"), ("diffusers", "all-linear")])
def test_load_lora_weights_matches_the_hooked_model(family, tiny_z_image, tmp_path, fmt, preset):
    """kohya: q/k/v stacked on ComfyUI's `attention.qkv`, which diffusers' converter splits back;
    comfy: ComfyUI's `diffusion_model.<diffusers module>` keys, which it reads for every layer."""
    from diffusers import ZImagePipeline

    adapters = perturbed_adapters(family, ["transformer"], layer_preset=preset)
    try:
        path = tmp_path / f"z-{fmt}.safetensors"
        save_adapter_file(path, adapters, family, fmt, torch.float32, {})
        ours = _output(family, family.transformer)
        pipe = ZImagePipeline.from_pretrained(str(tiny_z_image), local_files_only=True)
        pipe.load_lora_weights(str(path))
        theirs = _output(family, pipe.transformer)
        with_lora = {n for n, m in pipe.transformer.named_modules() if hasattr(m, "lora_A")}
        assert {adapters.module_name_of[n] for n in adapters.modules} <= with_lora  # no key ignored
        assert format_warnings(fmt, adapters, family) == []
        adapters.unhook()
        plain = _output(family, family.transformer)
        assert (ours - plain).abs().max() > 1e-3
        assert (ours - theirs).abs().max() < 1e-5
    finally:
        adapters.unhook()


def test_the_run_names_what_load_lora_weights_drops(family, tiny_z_image, tmp_path):
    """An all-linear kohya file: diffusers has no module for the original names of the embedder
    and final layer, and ZImagePipeline loads no text-encoder adapters; the warnings say which."""
    import re

    from diffusers import ZImagePipeline

    adapters = perturbed_adapters(family, ["transformer", "text_encoder"], layer_preset="all-linear")
    try:
        path = tmp_path / "z-kohya.safetensors"
        save_adapter_file(path, adapters, family, "kohya", torch.float32, {})
        warnings = format_warnings("kohya", adapters, family)
        wanted = {f"{adapters.part_of[n]}.{adapters.module_name_of[n]}" for n in adapters.modules}
    finally:
        adapters.unhook()
    pipe = ZImagePipeline.from_pretrained(str(tiny_z_image), local_files_only=True)
    pipe.load_lora_weights(str(path))
    loaded = {f"{part}.{n}" for part in ("transformer", "text_encoder")
              for n, m in getattr(pipe, part).named_modules() if hasattr(m, "lora_A")}
    dropped = wanted - loaded
    assert {d.split(".")[0] for d in dropped} == {"transformer", "text_encoder"}
    said = {}
    for warning in warnings:
        match = re.search(r"will not load (\d+) of these adapters \(e\.g\. ([^)]*)\)", warning)
        said[match.group(2)] = int(match.group(1))
        assert warning.startswith("output.format: 'kohya': diffusers' load_lora_weights")
    assert sum(said.values()) == len(dropped) and set(said) <= dropped
    assert any("model.parts.text_encoder.train" in w for w in warnings)
    assert any("adapter.layer_preset" in w for w in warnings)


def _original_transformer_file(folder, path):
    """The tiny diffusers transformer in the original layout (fused q/k/v, ComfyUI's names)."""
    state = load_file(str(next((folder / "transformer").glob("*.safetensors"))))
    out = {}
    for key, tensor in state.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q.weight" in key:
            fused = [state[key.replace("to_q", name)] for name in ("to_q", "to_k", "to_v")]
            out["model.diffusion_model." + key.replace("to_q.weight", "qkv.weight")] = torch.cat(fused)
            continue
        new = (key.replace("all_final_layer.2-1.", "final_layer.").replace("all_x_embedder.2-1.", "x_embedder.")
               .replace(".attention.to_out.0.", ".attention.out.").replace(".attention.norm_q.", ".attention.q_norm.")
               .replace(".attention.norm_k.", ".attention.k_norm."))
        out["model.diffusion_model." + new] = tensor
    save_file(out, str(path))
    return path


def test_an_original_layout_transformer_file_loads_the_same_tensors(tmp_path, tiny_z_image, shape_images, family):
    from modules.loading.diffusers_folder import ModelLoadError
    from modules.model.z_image import ZImageFamily

    file = _original_transformer_file(tiny_z_image, tmp_path / "z_image.safetensors")
    config = train_config(file, shape_images, tmp_path, {"model": {"family": "z_image"}})
    lacking = ZImageFamily(config)
    lacking.model_configs_dir = tiny_z_image
    with pytest.raises(ModelLoadError, match=r"model\.parts\.text_encoder\.path.*model\.parts\.vae\.path"):
        lacking.load()
    config = train_config(file, shape_images, tmp_path, {"model": {"family": "z_image", "parts": {
        "text_encoder": {"path": str(tiny_z_image / "text_encoder")}, "vae": {"path": str(tiny_z_image / "vae")}}}})
    from_file = ZImageFamily(config)
    from_file.model_configs_dir = tiny_z_image
    from_file.load()
    for part, module in family.parts.items():
        ours, theirs = from_file.parts[part].state_dict(), module.state_dict()
        assert set(ours) == set(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), part


def test_checkpoint_blocks_follow_the_forward_order(family):
    transformer = family.transformer
    assert family.checkpoint_blocks("transformer") == [*transformer.noise_refiner, *transformer.context_refiner,
                                                       *transformer.layers]


def test_z_image_presets_are_listed_and_valid():
    names = [p.name for p in list_presets() if p.family == "z_image"]
    assert "Z-Image LoRA 16GB" in names
    for name in names:
        config = build_config([load_preset_overlay(name)])
        assert config.model.family == "z_image" and set(config.model.parts) == {"text_encoder", "transformer", "vae"}


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("mode", MODES)
def test_each_base_precision_with_lora_and_dora_initializes_and_steps(tmp_path, tiny_z_image, one_image, mode, dora):
    initializes_and_steps(tiny_z_image, one_image, tmp_path, "z_image", "transformer", mode, dora)


def test_the_final_layer_stays_dense_when_the_transformer_is_quantized(tmp_path, tiny_z_image, shape_images):
    from modules.model.z_image import ZImageFamily
    from modules.quantization.base import QuantizedLinear

    family = ZImageFamily(train_config(tiny_z_image, shape_images, tmp_path, {
        "model": {"family": "z_image", "parts": {"transformer": {"weight_dtype": "float8"}}}}))
    family.load()
    report = family.quantization_reports["transformer"]
    assert "family" in report.skipped["all_final_layer.2-1.linear"]
    assert not isinstance(family.transformer.get_submodule("all_final_layer.2-1.linear"), QuantizedLinear)
    assert isinstance(family.transformer.get_submodule("layers.0.attention.to_q"), QuantizedLinear)


def test_a_scaled_fp8_transformer_file_applies_the_scale_of_fused_weights(tmp_path, tiny_z_image, shape_images):
    """ComfyUI scaled fp8: a fused q/k/v weight is dequantized with its scale before the split;
    a renamed weight keeps codes and scale for the loader."""
    from modules.model.z_image import ZImageFamily

    file = _original_transformer_file(tiny_z_image, tmp_path / "z.safetensors")
    tensors = load_file(str(file))
    expected = {}
    for key in ("model.diffusion_model.layers.0.attention.qkv.weight", "model.diffusion_model.layers.0.attention.out.weight"):
        scale = tensors[key].abs().max() / 448
        tensors[key] = (tensors[key] / scale).to(torch.float8_e4m3fn)
        tensors[key.replace(".weight", ".scale_weight")] = scale.reshape(1)
        tensors[key.replace(".weight", ".scale_input")] = torch.ones(1)
        expected[key] = tensors[key].to(torch.float32) * scale
    tensors["model.diffusion_model.scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    save_file(tensors, str(tmp_path / "scaled.safetensors"))
    config = train_config(tmp_path / "scaled.safetensors", shape_images, tmp_path, {"model": {
        "family": "z_image", "parts": {"text_encoder": {"path": str(tiny_z_image / "text_encoder")},
                                        "vae": {"path": str(tiny_z_image / "vae")}}}})
    family = ZImageFamily(config)
    family.model_configs_dir = tiny_z_image
    family.load()
    state = family.transformer.state_dict()
    fused = expected["model.diffusion_model.layers.0.attention.qkv.weight"].to(torch.bfloat16).float()
    assert torch.equal(state["layers.0.attention.to_k.weight"], fused.chunk(3)[1])
    assert torch.equal(state["layers.0.attention.to_out.0.weight"],
                       expected["model.diffusion_model.layers.0.attention.out.weight"])


def test_sample_draws_an_image_from_the_live_modules(family):
    from modules.config.train_config import SamplePromptConfig

    prompt = SamplePromptConfig(prompt="a red circle", negative_prompt="blurry", steps=2, cfg=2.0, width=64,
                                height=64, seed=3)
    image = family.sample(prompt, torch.device("cpu"))
    assert image.size == (64, 64)
    assert image.getextrema() != ((0, 0), (0, 0), (0, 0))



def test_the_transformer_runs_its_blocks_in_the_listed_order(family):
    latents = torch.randn(1, 16, 8, 8)
    text = family.encode_text(family.tokenize(["a"]))
    blocks_run_in_listed_order(family, "transformer", lambda: family.denoise(latents, torch.tensor([0.5]), text))


def test_a_skeleton_transformer_leaves_the_load_unchanged(family):
    loads_beside_a_skeleton_denoiser(family)  # what `launch.py cache` loads
