"""SD3.5 on a tiny offline model (CLIP-L, CLIP-G, T5, an MMDiT with a dual-attention block and a
context-pre-only last block): training learns under the flow target, diffusers-format files load
in `StableDiffusion3Pipeline.load_lora_weights` and compute what the trainer's hooked model
computes, a text encoder trains, and sampling runs the pipeline on the live modules."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import (
    blocks_run_in_listed_order,
    loads_beside_a_skeleton_denoiser,
    offloaded_training_matches,
    perturbed_adapters,
)

from modules.adapters.formats.files import save_adapter_file
from modules.trainer.generic_trainer import GenericTrainer


@pytest.fixture(scope="module")
def tiny_sd3(tiny_family_model):
    return tiny_family_model("sd3")


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_sd3, shape_images):
    from modules.model.sd3 import SD3Family

    family = SD3Family(train_config(tiny_sd3, shape_images, tmp_path_factory.mktemp("sd3"),
                                    {"model": {"family": "sd3"}}))
    family.load()
    return family


def test_sd3_trains_the_transformer_and_a_text_encoder_and_the_loss_falls(tmp_path, tiny_sd3, one_image):
    config = train_config(tiny_sd3, one_image, tmp_path, {
        "model": {"family": "sd3", "parts": {"transformer": {"gradient_checkpointing": True},
                                             "text_encoder_2": {"train": True}}},
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 25, "batch_size": 1},
        "optimizer": {"lr": 6e-3}, "output": {"format": "diffusers"},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    text_adapters = [n for n, p in trainer.adapters.part_of.items() if p == "text_encoder_2"]
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter (the CLIP-G ones too) learned
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert text_adapters and after < before * 0.8, (before, after)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        keys = list(file.keys())
    assert any(k.startswith("transformer.transformer_blocks.0.attn2.to_q.") for k in keys)
    assert any(k.startswith("text_encoder_2.text_model.encoder.layers.1.") for k in keys)


def test_sd3_predict_targets_the_flow_at_sigma_times_1000(family, monkeypatch):
    latents = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(0))
    text = family.encode_text(family.tokenize(["a", "b"]))
    assert text["hidden_states"].shape[1] == 77 + family.max_sequence_length
    seen = {}
    forward = family.transformer.forward

    def spy(*args, **kwargs):
        seen["timestep"] = kwargs["timestep"]
        return forward(*args, **kwargs)

    monkeypatch.setattr(family.transformer, "forward", spy)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        prediction, target, *_ = family.predict(latents, text, generator)
    assert prediction.shape == latents.shape
    replay = torch.Generator().manual_seed(3)
    noise = torch.randn(latents.shape, generator=replay)
    sigmas = family.sample_sigmas(2, 0, replay)
    assert torch.allclose(target, noise - latents)
    assert torch.allclose(seen["timestep"], sigmas * 1000)


def test_the_text_conditioning_is_the_pipelines(family):
    pipe = family.pipeline()
    with torch.no_grad():
        ours = family.encode_text(family.tokenize(["a red circle"]))
        embeds, _, pooled, _ = pipe.encode_prompt("a red circle", None, None, do_classifier_free_guidance=False,
                                                  max_sequence_length=family.max_sequence_length)
    assert torch.equal(ours["hidden_states"], embeds) and torch.equal(ours["pooled"], pooled)


def _outputs(family, transformer, clip_l, clip_g):
    tokens = family.tokenize(["a red circle on a blue background"])
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    parts = ("transformer", "text_encoder", "text_encoder_2")
    originals = {p: family.parts[p] for p in parts}
    family.parts.update(zip(parts, (transformer, clip_l, clip_g)))
    try:
        with torch.no_grad():
            text = family.encode_text(tokens)
            sample = family.denoise(latents, torch.tensor([0.5]), text)
    finally:
        family.parts.update(originals)
    return text["pooled"], text["hidden_states"], sample


def test_load_lora_weights_matches_the_hooked_model(family, tiny_sd3, tmp_path):
    from diffusers import StableDiffusion3Pipeline
    from peft.tuners.lora import LoraLayer

    adapters = perturbed_adapters(family, ["transformer", "text_encoder", "text_encoder_2"], layer_preset="all-linear")
    try:
        path = tmp_path / "sd3-diffusers.safetensors"
        save_adapter_file(path, adapters, family, "diffusers", torch.float32, {})
        ours = _outputs(family, family.transformer, family.parts["text_encoder"], family.parts["text_encoder_2"])
        pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3), local_files_only=True)
        pipe.load_lora_weights(str(path))
        loaded = sum(isinstance(m, LoraLayer) for c in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2)
                     for m in c.modules())
        assert loaded == len(adapters.modules), "diffusers left adapters of the file unused"
        theirs = _outputs(family, pipe.transformer, pipe.text_encoder, pipe.text_encoder_2)
        adapters.unhook()
        plain = _outputs(family, family.transformer, family.parts["text_encoder"], family.parts["text_encoder_2"])
        for mine, other, base in zip(ours, theirs, plain):
            assert (mine - base).abs().max() > 1e-3
            assert (mine - other).abs().max() < 1e-5
    finally:
        adapters.unhook()


def test_kohya_names_are_sd_scripts_mmdit_layers_and_comfy_is_kohya(family):
    from modules.adapters.formats.files import file_state, format_warnings

    adapters = perturbed_adapters(family, ["transformer", "text_encoder", "text_encoder_3"], layer_preset="all-linear")
    try:
        kohya, comfy = file_state(adapters, family, "kohya"), file_state(adapters, family, "comfy")
        warned = {fmt: [w for w in format_warnings(fmt, adapters, family) if "diffusers' load_lora_weights" in w]
                  for fmt in ("kohya", "diffusers")}
        t5 = sum(part == "text_encoder_3" for part in adapters.part_of.values())
    finally:
        adapters.unhook()
    # diffusers' SD3 loader has no converter for these names: the run says so (and of T5 for diffusers files)
    others = len(adapters.modules) - t5
    counts = sorted(int(w.split(" will not load ")[1].split(" of")[0]) for w in warned["kohya"])
    assert counts == sorted([others, t5])
    assert any("reads only diffusers-format files" in w for w in warned["kohya"])
    assert len(warned["diffusers"]) == 1 and f"will not load {t5} of these" in warned["diffusers"][0]
    stems = {k.split(".")[0] for k in kohya}
    last = len(family.transformer.transformer_blocks) - 1
    for stem in ("lora_unet_joint_blocks_0_x_block_attn_qkv", "lora_unet_joint_blocks_0_x_block_attn2_qkv",
                 "lora_unet_joint_blocks_0_context_block_attn_qkv", "lora_unet_joint_blocks_0_context_block_mlp_fc2",
                 f"lora_unet_joint_blocks_{last}_context_block_adaLN_modulation_1",
                 "lora_unet_final_layer_adaLN_modulation_1", "lora_unet_t_embedder_mlp_0",
                 "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"):
        assert stem in stems, stem
    assert any(s.startswith("lora_te3_encoder_block_0_") for s in stems)
    assert f"lora_unet_joint_blocks_{last}_context_block_attn_proj" not in stems  # pre-only: no such layer
    assert comfy.keys() == kohya.keys()


def test_checkpoint_blocks_are_the_joint_blocks_in_order(family):
    assert family.checkpoint_blocks("transformer") == list(family.transformer.transformer_blocks)
    assert len(family.checkpoint_blocks("text_encoder_3")) == 2
    latents = torch.randn(1, 16, 8, 8)
    text = family.encode_text(family.tokenize(["a"]))
    blocks_run_in_listed_order(family, "transformer", lambda: family.denoise(latents, torch.tensor([0.5]), text))


def test_offloading_half_the_transformer_trains_the_same_adapter(fake_device, tmp_path, tiny_sd3, one_image):
    offloaded_training_matches(tiny_sd3, one_image, tmp_path, "sd3", "transformer", fake_device)


def test_sample_draws_an_image_from_the_live_modules(family):
    from modules.config.train_config import SamplePromptConfig

    prompt = SamplePromptConfig(prompt="a red circle", negative_prompt="blurry", steps=2, cfg=4.0, width=64,
                                height=64, seed=3)
    image = family.sample(prompt, torch.device("cpu"))
    assert image.size == (64, 64)
    assert image.getextrema() != ((0, 0), (0, 0), (0, 0))


# --- single files ---------------------------------------------------------------------------


def _mmdit_name(stem: str) -> str:
    """sd-scripts' stem of an MMDiT layer (lora_unet_joint_blocks_0_x_block_attn_qkv) -> its
    weight name in Stability's file (joint_blocks.0.x_block.attn.qkv)."""
    import re

    name = re.sub(r"^joint_blocks_(\d+)_(x_block|context_block)_", r"joint_blocks.\1.\2.",
                  stem.removeprefix("lora_unet_"))
    for flat, dotted in (("adaLN_modulation_1", "adaLN_modulation.1"), ("attn2_", "attn2."), ("attn_", "attn."),
                         ("embedder_mlp_", "embedder.mlp."), ("mlp_", "mlp."), ("final_layer_", "final_layer.")):
        name = name.replace(flat, dotted)
    return name


def _transformer_to_stability(transformer) -> dict[str, torch.Tensor]:
    """The tiny transformer in Stability's MMDiT layout, written through the kohya key layout's
    original layers (keys/sd3.py): diffusers' converter then reading it back is the check that
    those names and their fused/swapped rows are MMDiT's."""
    from modules.model.keys.sd3 import SD3_TRANSFORMER_LAYERS

    state, out = transformer.state_dict(), {}
    for layer in SD3_TRANSFORMER_LAYERS.layers(transformer):
        for attr in ("weight", "bias"):
            tensor = torch.cat([state.pop(f"{m}.{attr}") for m in layer.members])
            out[f"{_mmdit_name(layer.stem)}.{attr}"] = torch.cat(tensor.chunk(2)[::-1]) if layer.swap_halves else tensor
    out["pos_embed"] = state.pop("pos_embed.pos_embed")
    for attr in ("weight", "bias"):
        out[f"x_embedder.proj.{attr}"] = state.pop(f"pos_embed.proj.{attr}")
    for key in list(state):  # the q/k RMS norms
        block, rest = key.split(".attn", 1) if ".attn" in key else (None, None)
        index = block.split(".")[1]
        attention, norm = rest.split(".")[0], rest.split(".")[1]
        side = "context_block" if norm.startswith("norm_added") else "x_block"
        out[f"joint_blocks.{index}.{side}.attn{attention}.ln_{norm[-1]}.weight"] = state.pop(key)
    assert not state, state.keys()
    return out


def test_a_stability_single_file_loads_the_same_tensors(tmp_path, tiny_sd3, shape_images, family):
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file, save_file
    from test_single_file import _vae_to_ldm

    from modules.model.sd3 import SD3Family

    def folder_state(part):
        return load_file(str(next((tiny_sd3 / part).glob("*.safetensors"))))

    tensors = {"model.diffusion_model." + k: v for k, v in _transformer_to_stability(family.transformer).items()}
    tensors.update(_vae_to_ldm(AutoencoderKL.from_pretrained(str(tiny_sd3 / "vae")), folder_state("vae")))
    for part, name in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g"), ("text_encoder_3", "t5xxl")):
        tensors.update({f"text_encoders.{name}.transformer.{k}": v for k, v in folder_state(part).items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "sd3.safetensors"))
    from_file = SD3Family(train_config(tmp_path / "sd3.safetensors", shape_images, tmp_path,
                                       {"model": {"family": "sd3"}}))
    from_file.model_configs_dir = tiny_sd3
    from_file.load()
    for part, module in family.parts.items():
        ours, theirs = from_file.parts[part].state_dict(), module.state_dict()
        assert set(ours) == set(theirs), part
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), part


@pytest.mark.parametrize("keys, variant", [
    (["joint_blocks.37.x_block.attn.ln_q.weight"], "transformer"),
    (["joint_blocks.23.x_block.attn.ln_q.weight", "joint_blocks.12.x_block.attn2.qkv.weight"],
     "transformer_sd35_medium"),
    (["joint_blocks.23.x_block.attn.qkv.weight"], "transformer_sd3_medium"),
], ids=["sd3.5-large", "sd3.5-medium", "sd3-medium"])
def test_a_single_file_builds_the_transformer_of_its_variant(tmp_path, tiny_sd3, shape_images, keys, variant):
    from safetensors.torch import save_file

    from modules.model.sd3 import SD3Family

    path = tmp_path / "sd3.safetensors"
    save_file({f"model.diffusion_model.{k}": torch.zeros(1) for k in keys}, str(path))
    apart = {part: {"path": str(tiny_sd3 / part)}
             for part in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")}
    family = SD3Family(train_config(path, shape_images, tmp_path, {"model": {"family": "sd3", "parts": apart}}))
    folder = family.part_folder("transformer")
    assert folder.name == variant
    config = json.loads((folder / "config.json").read_text())
    assert config["num_layers"] == int(keys[0].split(".")[1]) + 1


def test_an_embedding_trains_in_both_clips_beside_a_lora(tmp_path, tiny_sd3, shape_images):
    """SD3's CLIP-L, CLIP-G and T5 take textual-inversion vectors (ComfyUI's SD3 file keys clip_l,
    clip_g, t5xxl)."""
    from safetensors.torch import load_file

    from modules.model.components.embedding_tokens import init_vectors, token_embedding

    placeholder = "<shape>"
    config = train_config(tiny_sd3, shape_images, tmp_path, {
        "model": {"family": "sd3"}, "schedule": {"max_steps": 2}, "optimizer": {"lr": 5e-2},
        "embeddings": [{"placeholder": placeholder, "init_text": "a", "vectors": 1}],
        "concepts": [{"path": str(shape_images), "captions": {"prefix": f"{placeholder} "}}]})
    trainer = GenericTrainer(config)
    trainer.start()
    assert [m.name for m in trainer.methods] == ["adapter", "embedding"]
    trainer.train()
    path = trainer.end()
    saved = load_file(str(path.with_name(f"{path.stem}.shape.safetensors")))
    family = trainer.family
    t5_width = family.parts["text_encoder_3"].config.d_model
    assert {k: tuple(v.shape) for k, v in saved.items()} == {"clip_l": (1, 32), "clip_g": (1, 32),
                                                             "t5xxl": (1, t5_width)}
    for part, key, tokenizer in (("text_encoder", "clip_l", family.tokenizer),
                                 ("text_encoder_2", "clip_g", family.tokenizer_2),
                                 ("text_encoder_3", "t5xxl", family.tokenizer_3)):
        initial = init_vectors(tokenizer, token_embedding(family.parts[part]).weight, "a", 1, key)
        assert not torch.allclose(saved[key], initial.to(saved[key].dtype)), key


def test_a_skeleton_transformer_leaves_the_load_unchanged(family):
    loads_beside_a_skeleton_denoiser(family)  # what `launch.py cache` loads
