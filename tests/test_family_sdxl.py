"""SDXL on a tiny offline model: training learns, and the files it writes load in diffusers'
`StableDiffusionXLPipeline.load_lora_weights` (kohya names as sd-scripts writes them for SDXL,
and diffusers names) and compute what the trainer's hooked model computes."""

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

from modules.adapters.formats.files import file_state, save_adapter_file
from modules.config.loading import build_config
from modules.config.presets import list_presets, load_preset_overlay
from modules.trainer.generic_trainer import GenericTrainer


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory):
    from modules.model.sdxl import SDXLFamily

    return SDXLFamily.make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-sdxl")


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_sdxl, shape_images):
    from modules.model.sdxl import SDXLFamily

    config = train_config(tiny_sdxl, shape_images, tmp_path_factory.mktemp("sdxl"), {"model": {"family": "sdxl"}})
    family = SDXLFamily(config)
    family.load()
    return family


def test_sdxl_trains_a_lora_and_the_loss_falls(tmp_path, tiny_sdxl, one_image):
    config = train_config(tiny_sdxl, one_image, tmp_path, {
        "model": {"family": "sdxl", "parts": {"text_encoder_2": {"train": True},
                                              "unet": {"gradient_checkpointing": True}}},
        # 22 steps: fixed_loss falls to 0.66-0.67x of its start over seeds 42, 1, 2, 3 (the test needs < 0.8x)
        "adapter": {"layer_preset": "all"}, "schedule": {"epochs": 22, "batch_size": 1}, "optimizer": {"lr": 3e-3},
    })
    trainer = GenericTrainer(config)
    trainer.start()  # the first step's guard (every adapter learns) runs inside train()
    before = fixed_loss(trainer, draws=8)
    trainer.train()
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert after < before * 0.8, (before, after)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        keys, metadata = list(file.keys()), file.metadata()
    assert metadata["ss_base_model_version"] == "sdxl_base_v1-0"
    assert any(k.startswith("lora_unet_input_blocks_") for k in keys)  # sd-scripts' SDXL names
    assert any(k.startswith("lora_te2_text_model_encoder_layers_") for k in keys)


def _outputs(family, unet, text_encoders):
    tokens = family.tokenize(["a red circle on a blue background"])
    latents = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        first = text_encoders[0](tokens["input_ids"], output_hidden_states=True)
        second = text_encoders[1](tokens["input_ids_2"], output_hidden_states=True)
        text = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1)
        pooled = second.text_embeds
        sample = unet(latents, torch.tensor([500]), encoder_hidden_states=text,
                      added_cond_kwargs={"text_embeds": pooled, "time_ids": family.time_ids(latents)}).sample
    return text, pooled, sample


@pytest.fixture(scope="module")
def pipe(tiny_sdxl):
    """diffusers' pipeline on the tiny folder, read once for both formats' files (each unloaded after its test)."""
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(str(tiny_sdxl), local_files_only=True)


@pytest.mark.parametrize("fmt", ["kohya", "diffusers"])
def test_load_lora_weights_matches_the_hooked_model(family, pipe, tmp_path, fmt):
    from peft.tuners.lora import LoraLayer

    parts = ["unet", "text_encoder", "text_encoder_2"]
    adapters = perturbed_adapters(family, parts, layer_preset="all")
    components = (pipe.unet, pipe.text_encoder, pipe.text_encoder_2)
    assert not any(isinstance(m, LoraLayer) for c in components for m in c.modules())  # the other format's is gone
    try:
        path = tmp_path / f"sdxl-{fmt}.safetensors"
        save_adapter_file(path, adapters, family, fmt, torch.float32, {})
        ours = _outputs(family, family.unet, (family.parts["text_encoder"], family.parts["text_encoder_2"]))
        pipe.load_lora_weights(str(path))
        theirs = _outputs(family, pipe.unet, (pipe.text_encoder, pipe.text_encoder_2))
        adapters.unhook()
        plain = _outputs(family, family.unet, (family.parts["text_encoder"], family.parts["text_encoder_2"]))
        for mine, other, base in zip(ours, theirs, plain):
            assert (mine - base).abs().max() > 1e-3  # the adapter does something worth matching
            assert (mine - other).abs().max() < 1e-5
    finally:
        adapters.unhook()
        pipe.unload_lora_weights()


def test_kohya_and_comfy_names(family):
    adapters = perturbed_adapters(family, ["unet", "text_encoder", "text_encoder_2"], layer_preset="all")
    try:
        kohya = set(file_state(adapters, family, "kohya"))
        comfy = set(file_state(adapters, family, "comfy"))
    finally:
        adapters.unhook()
    # sd-scripts' SDXL names: the UNet's original block paths, te1 = CLIP-L, te2 = CLIP-G
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in kohya
    assert "lora_unet_middle_block_1_transformer_blocks_1_ff_net_2.lora_up.weight" in kohya
    assert "lora_unet_output_blocks_2_2_conv.alpha" in kohya  # the upsampler after attention
    assert "lora_unet_label_emb_0_0.lora_down.weight" in kohya
    assert "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight" in kohya
    assert "lora_te2_text_model_encoder_layers_1_mlp_fc2.lora_up.weight" in kohya
    assert "diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_q.lora_down.weight" in comfy
    # text encoders keep kohya's names in comfy files: ComfyUI and Forge both match them
    assert "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.alpha" in comfy
    assert "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.alpha" in comfy


def test_checkpoint_blocks_cover_the_unet_in_order(family):
    blocks = family.checkpoint_blocks("unet")
    assert blocks[0] is family.unet.down_blocks[0].resnets[0]
    assert blocks[-1] is family.unet.up_blocks[-1].resnets[-1]
    assert len(family.checkpoint_blocks("text_encoder_2")) == family.parts["text_encoder_2"].config.num_hidden_layers


def test_sdxl_presets_are_listed_and_valid():
    names = [p.name for p in list_presets() if p.family == "sdxl"]
    assert "SDXL LoRA 12GB" in names
    for name in names:
        config = build_config([load_preset_overlay(name)])
        assert config.model.family == "sdxl" and set(config.model.parts) == {
            "text_encoder", "text_encoder_2", "unet", "vae"}


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("mode", MODES)
def test_each_base_precision_with_lora_and_dora_initializes_and_steps(tmp_path, tiny_sdxl, one_image, mode, dora):
    initializes_and_steps(tiny_sdxl, one_image, tmp_path, "sdxl", "unet", mode, dora)


def test_sample_draws_an_image_from_the_live_modules(family):
    from modules.config.train_config import SamplePromptConfig

    prompt = SamplePromptConfig(prompt="a red circle", negative_prompt="blurry", steps=2, cfg=2.0, width=64,
                                height=64, seed=3)
    image = family.sample(prompt, torch.device("cpu"))
    assert image.size == (64, 64)
    assert image.getextrema() != ((0, 0), (0, 0), (0, 0))


def test_offloading_half_the_unet_trains_the_same_adapter(fake_device, tmp_path, tiny_sdxl, one_image):
    offloaded_training_matches(tiny_sdxl, one_image, tmp_path, "sdxl", "unet", fake_device)


def test_the_unet_runs_its_blocks_in_the_listed_order(family):
    latents = torch.randn(1, 4, 16, 16)
    text = family.encode_text(family.tokenize(["a"]))
    blocks_run_in_listed_order(family, "unet", lambda: family.unet(
        latents, torch.tensor([10]), encoder_hidden_states=text["hidden_states"],
        added_cond_kwargs={"text_embeds": text["pooled"], "time_ids": family.time_ids(latents)}))


def test_a_skeleton_unet_leaves_the_load_unchanged(family):
    loads_beside_a_skeleton_denoiser(family)  # what `launch.py cache` loads
