"""Chroma on a tiny offline model: training learns under the flow target (transformer and T5),
padding tokens are masked (more padding changes no prediction), the diffusers file loads in
`ChromaPipeline.load_lora_weights` with every adapter used and computes what the trainer's hooked
model computes, blocks run in the listed order, the single original-layout file loads the folder's
tensors, and sampling draws an image from the live modules."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import loads_beside_a_skeleton_denoiser, perturbed_adapters
from test_family_flux import _transformer_to_bfl

from modules.adapters.adapter_set import build_adapter_set
from modules.adapters.formats.files import save_adapter_file
from modules.config.train_config import AdapterConfig


@pytest.fixture(scope="session")
def tiny_chroma(tiny_family_model):
    return tiny_family_model("chroma")


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_chroma, shape_images):
    from modules.model.chroma import ChromaFamily

    family = ChromaFamily(train_config(tiny_chroma, shape_images, tmp_path_factory.mktemp("chroma"),
                                       {"model": {"family": "chroma"}}))
    family.load()
    return family


def test_chroma_trains_the_transformer_and_t5_and_the_loss_falls(tmp_path, tiny_chroma, one_image):
    from safetensors import safe_open

    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_chroma, one_image, tmp_path, {
        "model": {"family": "chroma", "parts": {"transformer": {"gradient_checkpointing": True},
                                                "text_encoder": {"train": True}}},
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 20, "batch_size": 1},
        "optimizer": {"lr": 6e-3},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter, T5's too, learned
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert after < before * 0.8, (before, after)
    with safe_open(str(path), "pt") as file:
        keys = list(file.keys())
        assert file.metadata()["ss_base_model_version"] == "chroma"
    # the original layers (fused q/k/v and linear1), the distilled guidance layer, T5 as ComfyUI names it
    for stem in ("lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_1_linear1",
                 "lora_unet_distilled_guidance_layer_layers_1_out_layer", "lora_unet_final_layer_linear",
                 "lora_te1_encoder_block_0_layer_0_SelfAttention_q"):
        assert f"{stem}.lora_down.weight" in keys, stem


def test_predict_targets_the_flow(family):
    latents = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(0))
    text = family.encode_text(family.tokenize(["a", "b"]))
    with torch.no_grad():
        prediction, target, *_ = family.predict(latents, text, torch.Generator().manual_seed(3))
    assert prediction.shape == latents.shape
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(target, noise - latents)


def test_padding_tokens_are_masked(family):
    """A caption padded to 16 or to 32 tokens predicts the same (the transformer sees the real
    tokens and the first padding token only); a longer caption predicts something else."""
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    length = family.tokenizer.model_max_length

    def prediction(caption, max_length):
        family.tokenizer.model_max_length = max_length
        try:
            text = family.encode_text(family.tokenize([caption]))
        finally:
            family.tokenizer.model_max_length = length
        with torch.no_grad():
            return family.denoise(latents, torch.tensor([0.5]), text)

    short, long = prediction("a cat", 16), prediction("a cat", 32)
    assert torch.allclose(short, long, atol=1e-6), (short - long).abs().max()
    assert (prediction("a cat sat", 16) - short).abs().max() > 1e-4


def _outputs(family, transformer, text_encoder):
    """(T5 hidden states, the transformer's prediction) with the given modules in place."""
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    originals = dict(family.parts)
    family.parts.update(transformer=transformer, text_encoder=text_encoder)
    try:
        with torch.no_grad():
            text = family.encode_text(family.tokenize(["a red circle on a blue background"]))
            return text["hidden_states"], family.denoise(latents, torch.tensor([0.5]), text)
    finally:
        family.parts.update(originals)


def test_load_lora_weights_matches_the_hooked_model(family, tiny_chroma, tmp_path):
    """A diffusers-format file of every Linear layer of the transformer (the distilled guidance
    layer too) loads in ChromaPipeline with no adapter left out and computes what the trainer computes."""
    from diffusers import ChromaPipeline
    from peft.tuners.lora import LoraLayer

    adapters = perturbed_adapters(family, ["transformer"], layer_preset="all-linear")
    try:
        path = tmp_path / "chroma-diffusers.safetensors"
        save_adapter_file(path, adapters, family, "diffusers", torch.float32, {})
        ours = _outputs(family, family.transformer, family.parts["text_encoder"])
        count = len(adapters)
        assert any("distilled_guidance_layer" in name for name in adapters.part_of)
    finally:
        adapters.unhook()
    plain = _outputs(family, family.transformer, family.parts["text_encoder"])
    pipe = ChromaPipeline.from_pretrained(str(tiny_chroma), local_files_only=True)
    pipe.load_lora_weights(str(path))
    assert sum(isinstance(m, LoraLayer) for m in pipe.transformer.modules()) == count
    theirs = _outputs(family, pipe.transformer, pipe.text_encoder)
    mine, other, base = ours[1], theirs[1], plain[1]
    assert (mine - base).abs().max() > 1e-3
    assert (mine - other).abs().max() < 1e-5


@pytest.mark.parametrize("fmt", ["kohya", "diffusers"])
def test_the_run_says_diffusers_refuses_t5_adapters(family, tmp_path, fmt):
    from diffusers import ChromaPipeline

    from modules.adapters.formats.files import format_warnings

    adapters = perturbed_adapters(family, ["text_encoder"], layer_preset="attn")
    try:
        path = tmp_path / f"t5-{fmt}.safetensors"
        save_adapter_file(path, adapters, family, fmt, torch.float32, {})
        said = [w for w in format_warnings(fmt, adapters, family) if "diffusers' load_lora_weights" in w]
    finally:
        adapters.unhook()
    assert len(said) == 1 and f"refuses the whole file: {len(adapters)} of these adapters" in said[0]
    assert "model.parts.text_encoder.train" in said[0]
    pipe = ChromaPipeline(scheduler=None, vae=None, text_encoder=family.parts["text_encoder"], tokenizer=None,
                          transformer=family.transformer)
    with pytest.raises(ValueError):  # what the warning warns of
        pipe.load_lora_weights(str(path))
    pipe.unload_lora_weights()


def test_the_transformer_runs_its_blocks_in_the_listed_order(family):
    from family_cross import blocks_run_in_listed_order

    transformer = family.transformer
    blocks = family.checkpoint_blocks("transformer")
    assert blocks == [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    latents = torch.randn(1, 16, 8, 8)
    text = family.encode_text(family.tokenize(["a"]))
    blocks_run_in_listed_order(family, "transformer", lambda: family.denoise(latents, torch.tensor([0.5]), text))
    blocks_run_in_listed_order(family, "text_encoder", lambda: family.encode_text(family.tokenize(["a"])))


def _transformer_to_original(state: dict) -> dict:
    """diffusers ChromaTransformer2DModel keys -> the original layout (FLUX's blocks, the approximator)."""
    approximator = {k: v for k, v in state.items() if k.startswith("distilled_guidance_layer.")}
    out = _transformer_to_bfl({k: v for k, v in state.items() if k not in approximator})
    for key, tensor in approximator.items():
        if ".norms." in key:
            key = key.removesuffix(".weight") + ".scale"
        out[key.replace(".linear_1.", ".in_layer.").replace(".linear_2.", ".out_layer.")] = tensor
    return out


def test_the_single_transformer_file_loads_the_folders_tensors(tmp_path, tiny_chroma, shape_images, family):
    from safetensors.torch import load_file, save_file

    from modules.model.chroma import ChromaFamily
    from modules.model.detect import detect_family

    folder = load_file(str(next((tiny_chroma / "transformer").glob("*.safetensors"))))
    original = {"model.diffusion_model." + k: v.contiguous() for k, v in _transformer_to_original(folder).items()}
    assert "model.diffusion_model.distilled_guidance_layer.norms.0.scale" in original
    save_file(original, str(tmp_path / "chroma.safetensors"))
    assert detect_family(tmp_path / "chroma.safetensors") == "chroma"  # not FLUX, whose blocks it shares
    assert detect_family(tiny_chroma) == "chroma"
    # as Chroma ships: the transformer file, the T5 encoder and the VAE as folders
    config = train_config(tmp_path / "chroma.safetensors", shape_images, tmp_path, {"model": {
        "family": "chroma", "parts": {"text_encoder": {"path": str(tiny_chroma / "text_encoder")},
                                      "vae": {"path": str(tiny_chroma / "vae")}}}})
    from_file = ChromaFamily(config)
    from_file.model_configs_dir = tiny_chroma  # the tiny model's part configs
    from_file.load()
    for part, module in family.parts.items():
        ours, theirs = from_file.parts[part].state_dict(), module.state_dict()
        assert set(ours) == set(theirs), part
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), part


def test_the_chroma_converter_agrees_with_diffusers_on_the_released_shapes():
    """diffusers' converter fixes the width at Chroma's 3072; ours reads it from the tensors. On the
    released architecture (meta tensors, real ones for the split layers) both give the same."""
    from pathlib import Path

    from accelerate import init_empty_weights
    from diffusers import ChromaTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    from modules.model.chroma import chroma_transformer_to_diffusers

    folder = Path(__file__).resolve().parents[1] / "resources" / "model_configs" / "chroma" / "transformer"
    with init_empty_weights():
        model = ChromaTransformer2DModel.from_config(ChromaTransformer2DModel.load_config(str(folder)))
    original = _transformer_to_original(model.state_dict())
    generator = torch.Generator().manual_seed(0)
    for key in ("double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight",
                "single_blocks.0.linear1.bias", "distilled_guidance_layer.norms.0.scale"):
        original[key] = torch.randint(-100, 100, original[key].shape, generator=generator, dtype=torch.int8)
    ours = chroma_transformer_to_diffusers(dict(original))
    theirs = convert_chroma_transformer_checkpoint_to_diffusers(dict(original))
    assert set(ours) == set(theirs) == set(model.state_dict())
    for key in ours:
        assert ours[key].shape == theirs[key].shape, key
        if not ours[key].is_meta:
            assert torch.equal(ours[key], theirs[key]), key


def test_sample_draws_an_image_from_the_live_modules(family):
    from modules.config.train_config import SamplePromptConfig

    prompt = SamplePromptConfig(prompt="a red circle", negative_prompt="blurry", steps=2, cfg=2.0, width=64,
                                height=64, seed=3)
    image = family.sample(prompt, torch.device("cpu"))
    assert image.size == (64, 64)
    assert image.getextrema() != ((0, 0), (0, 0), (0, 0))


@pytest.mark.parametrize("mode", ["float8", "nf4"])
def test_a_quantized_transformer_trains(tmp_path, tiny_chroma, one_image, mode):
    from family_cross import initializes_and_steps

    initializes_and_steps(tiny_chroma, one_image, tmp_path, "chroma", "transformer", mode, dora=False)


def test_the_distilled_guidance_layer_stays_dense(tmp_path, tiny_chroma, shape_images):
    from modules.model.chroma import ChromaFamily

    family = ChromaFamily(train_config(tiny_chroma, shape_images, tmp_path, {"model": {
        "family": "chroma", "parts": {"transformer": {"weight_dtype": "float8"}}}}), {"transformer": "float8"})
    family.load()
    report = family.quantization_reports["transformer"]
    approximator = [n for n, m in family.transformer.named_modules()
                    if n.startswith("distilled_guidance_layer.") and isinstance(m, torch.nn.Linear)]
    assert approximator and all(n in report.skipped for n in approximator)
    assert any(n.startswith("transformer_blocks.") for n in report.quantized)


def test_offloading_half_the_transformer_trains_the_same_adapter(fake_device, tmp_path, tiny_chroma, one_image):
    from family_cross import offloaded_training_matches

    offloaded_training_matches(tiny_chroma, one_image, tmp_path, "chroma", "transformer", fake_device)


def test_a_kohya_file_loads_in_diffusers_and_back(tmp_path, shape_images):
    """sd-scripts' names on the original layers (q/k/v stacked): ChromaPipeline's kohya-FLUX
    converter loads every layer of attn-mlp and computes what the trainer computes; our loader reads
    the file back into the per-module adapters. A double block at tiny width (diffusers splits
    single blocks' linear1 at the released width only, FLUX's names: tests/test_flux_kohya_files.py)."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel

    from modules.adapters.formats.files import load_adapter_file
    from modules.model.chroma import ChromaFamily

    torch.manual_seed(0)
    transformer = ChromaTransformer2DModel(
        num_layers=1, num_single_layers=0, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6), approximator_num_channels=16, approximator_hidden_dim=32,
        approximator_layers=1).eval()
    family = ChromaFamily(train_config(tmp_path / "unused", shape_images, tmp_path, {"model": {"family": "chroma"}}))
    family.parts["transformer"] = transformer
    generator = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 4, 64, generator=generator),
                  encoder_hidden_states=torch.randn(1, 3, 32, generator=generator), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(4, 3), txt_ids=torch.zeros(3, 3), return_dict=False)

    def output():
        with torch.no_grad():
            return transformer(**inputs)[0]

    plain = output()
    adapters = perturbed_adapters(family, ["transformer"], layer_preset="attn-mlp")
    try:
        ours, state = output(), adapters.state_dict()
        path = tmp_path / "chroma-kohya.safetensors"
        save_adapter_file(path, adapters, family, "kohya", torch.float32, {})
        modules = {adapters.module_name_of[n] for n in adapters.modules}
    finally:
        adapters.unhook()
    pipe = ChromaPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=transformer)
    pipe.load_lora_weights(str(path))
    try:
        theirs = output()
        with_lora = {name for name, module in transformer.named_modules() if hasattr(module, "lora_A")}
    finally:
        pipe.unload_lora_weights()
    assert modules <= with_lora
    assert (ours - plain).abs().max() > 1e-3
    assert (ours - theirs).abs().max() < 1e-5
    again = perturbed_adapters(family, ["transformer"], layer_preset="attn-mlp")
    try:
        load_adapter_file(path, again, family)
        for key, tensor in again.state_dict().items():
            assert torch.allclose(tensor, state[key], atol=1e-7), key
    finally:
        again.unhook()


# ComfyUI's key map for Chroma (comfy/lora.py, a fact reproduced independently): its Chroma model
# is a Flux one (comfy/model_base.py `class Chroma(Flux)`), so per weight `diffusion_model.<X>` of
# the original layout it maps `lora_unet_<X with _>` and `diffusion_model.<X>`, and per diffusers
# module D that comfy/utils.py `flux_to_diffusers` knows (no distilled guidance layer)
# `transformer.<D>`, `lycoris_<D with _>`, `lora_transformer_<D with _>`; the lone T5's weights
# `t5xxl.transformer.<k>` as `lora_te1_<k with _>` and `text_encoders.t5xxl.transformer.<k>`.
def _comfyui_chroma_map(family) -> set[str]:
    original = [k.removesuffix(".weight") for k in _transformer_to_original(family.transformer.state_dict())
                if k.endswith(".weight")]
    stems = {f"lora_unet_{x.replace('.', '_')}" for x in original} | {f"diffusion_model.{x}" for x in original}
    for name, module in family.transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.startswith("distilled_guidance_layer."):
            stems |= {f"transformer.{name}", f"lycoris_{name.replace('.', '_')}",
                      f"lora_transformer_{name.replace('.', '_')}"}
    t5 = [k.removesuffix(".weight") for k in family.parts["text_encoder"].state_dict() if k.endswith(".weight")]
    return stems | {f"lora_te1_{k.replace('.', '_')}" for k in t5} | {f"text_encoders.t5xxl.transformer.{k}" for k in t5}


@pytest.mark.parametrize("adapter", [{"type": "lora"}, {"type": "loha"}, {"type": "lokr"}], ids=["lora", "loha", "lokr"])
def test_every_kohya_stem_is_one_comfyui_maps_and_diffusers_files_say_what_it_skips(family, adapter, tmp_path):
    import re

    from modules.adapters.formats.files import file_state, format_warnings, load_adapter_file

    adapters = build_adapter_set(family, AdapterConfig(rank=2, layer_preset="all-linear", **adapter),
                                 ["transformer", "text_encoder"], torch.device("cpu"))
    try:
        comfyui = _comfyui_chroma_map(family)

        def stems(fmt):
            return {re.sub(r"\.(lora_down\.weight|lora_up\.weight|lora_A\.weight|lora_B\.weight|alpha|hada_\w+"
                           r"|lokr_\w+)$", "", k) for k in file_state(adapters, family, fmt)}

        for fmt in ("kohya", "comfy"):
            assert not stems(fmt) - comfyui, sorted(stems(fmt) - comfyui)[:5]
        if adapter["type"] == "lora":
            unread = stems("diffusers") - comfyui
            warned = [w for w in format_warnings("diffusers", adapters, family) if "ComfyUI" in w]
            assert unread and sum(int(re.search(r"will not load (\d+)", w).group(1)) for w in warned) == len(unread)
        with torch.no_grad():  # and the kohya file reads back into the same adapters
            for parameter in adapters.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(4)) * 0.05)
        state = {k: v.clone() for k, v in adapters.state_dict().items()}
        save_adapter_file(tmp_path / "kohya.safetensors", adapters, family, "kohya", torch.float32, {})
        with torch.no_grad():
            for parameter in adapters.parameters():
                parameter.zero_()
        load_adapter_file(tmp_path / "kohya.safetensors", adapters, family)
        for key, tensor in adapters.state_dict().items():
            assert torch.allclose(tensor, state[key], atol=1e-6), key
    finally:
        adapters.unhook()


def test_a_skeleton_transformer_leaves_the_load_unchanged(family):
    loads_beside_a_skeleton_denoiser(family)  # what `launch.py cache` loads
