"""Qwen-Image on a tiny offline model: training learns under the flow target (transformer and the
Qwen2.5-VL language model), the prompt embeddings are QwenImagePipeline's own (template, 34
tokens dropped, mask), padding tokens are masked, kohya and diffusers files load in
`QwenImagePipeline.load_lora_weights` with every adapter used and compute what the trainer's hooked
model computes, every saved stem is one ComfyUI maps, blocks run in the listed order, the single
ComfyUI-layout transformer file loads the folder's tensors, sampling runs true CFG from the live
modules, quantized transformers train and offloading half the blocks trains the same adapter."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import loads_beside_a_skeleton_denoiser, perturbed_adapters, prediction_with

from modules.adapters.adapter_set import build_adapter_set
from modules.adapters.formats.files import file_state, format_warnings, save_adapter_file
from modules.config.train_config import AdapterConfig


@pytest.fixture(scope="session")
def tiny_qwen_image(tiny_family_model):
    return tiny_family_model("qwen_image")


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_qwen_image, shape_images):
    from modules.model.qwen_image import QwenImageFamily

    family = QwenImageFamily(train_config(tiny_qwen_image, shape_images, tmp_path_factory.mktemp("qwen"),
                                          {"model": {"family": "qwen_image"}}))
    family.load()
    return family


def test_qwen_image_trains_the_transformer_and_text_encoder_and_the_loss_falls(tmp_path, tiny_qwen_image, one_image):
    from safetensors import safe_open

    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_qwen_image, one_image, tmp_path, {
        "model": {"family": "qwen_image", "parts": {"transformer": {"gradient_checkpointing": True},
                                                    "text_encoder": {"train": True}}},
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 20, "batch_size": 1},
        "optimizer": {"lr": 6e-3},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter, the text encoder's too, learned
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert after < before * 0.8, (before, after)
    with safe_open(str(path), "pt") as file:
        keys = list(file.keys())
        assert file.metadata()["ss_base_model_version"] == "qwen_image"
    for stem in ("lora_unet_transformer_blocks_0_attn_to_q", "lora_unet_transformer_blocks_1_img_mlp_net_0_proj",
                 "lora_unet_transformer_blocks_0_txt_mod_1", "lora_unet_norm_out_linear",
                 "text_encoders.qwen25_7b.transformer.model.layers.0.self_attn.q_proj",
                 "text_encoders.qwen25_7b.transformer.model.layers.1.mlp.down_proj"):
        assert f"{stem}.lora_down.weight" in keys, stem


def test_predict_targets_the_flow_and_the_embeddings_are_the_pipelines(family, tiny_qwen_image):
    """QwenImagePipeline.encode_prompt on the same modules gives the family's embeddings and mask
    (the template's first 34 tokens dropped, the rest at the front); predict targets noise - latents."""
    from diffusers import QwenImagePipeline

    captions = ["a red circle", "a much longer caption about a small blue square on the left"]
    text = family.encode_text(family.tokenize(captions))
    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=family.tokenizer,
                             transformer=None)
    pipe.text_encoder = _as_vl_model(tiny_qwen_image)
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(captions, device=torch.device("cpu"),
                                          max_sequence_length=family.max_sequence_length)
    length = embeds.shape[1]
    assert torch.equal(mask, text["attention_mask"][:, :length]) and not text["attention_mask"][:, length:].any()
    assert (embeds - text["hidden_states"][:, :length]).abs().max() < 1e-5
    assert mask.sum(1)[0] < mask.sum(1)[1]  # captions of different lengths: a real mask

    latents = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prediction, target, *_ = family.predict(latents, text, torch.Generator().manual_seed(3))
    assert prediction.shape == latents.shape
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(target, noise - latents)


def _as_vl_model(folder):
    """The released text encoder class read from the tiny folder (what the pipeline itself runs)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(folder / "text_encoder")).eval()


def test_padding_tokens_are_masked(family):
    """A caption padded to 16 or to 32 text tokens predicts the same; a longer caption does not."""
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

    short, long = prediction("a cat", 34 + 16), prediction("a cat", 34 + 32)
    assert torch.allclose(short, long, atol=1e-6), (short - long).abs().max()
    assert (prediction("a cat sat", 34 + 16) - short).abs().max() > 1e-4


@pytest.mark.parametrize("fmt", ["diffusers", "kohya"])
def test_load_lora_weights_matches_the_hooked_model(family, tiny_qwen_image, tmp_path, fmt):
    """Every Linear layer of the transformer, in either format, loads in QwenImagePipeline with no
    adapter left out and computes what the trainer's hooked model computes."""
    from diffusers import QwenImagePipeline
    from peft.tuners.lora import LoraLayer

    from modules.adapters.formats.files import load_adapter_file

    adapters = perturbed_adapters(family, ["transformer"], layer_preset="all-linear")
    try:
        path = tmp_path / f"qwen-{fmt}.safetensors"
        save_adapter_file(path, adapters, family, fmt, torch.float32, {})
        ours, count, state = prediction_with(family, family.transformer, 16), len(adapters), adapters.state_dict()
        assert not format_warnings(fmt, adapters, family)
    finally:
        adapters.unhook()
    again = build_adapter_set(family, AdapterConfig(rank=4, alpha=2, layer_preset="all-linear"), ["transformer"],
                              torch.device("cpu"))
    try:  # and the file reads back into the trainer's adapters
        load_adapter_file(path, again, family)
        assert all(torch.allclose(tensor, state[key], atol=1e-7) for key, tensor in again.state_dict().items())
    finally:
        again.unhook()
    plain = prediction_with(family, family.transformer, 16)
    pipe = QwenImagePipeline.from_pretrained(str(tiny_qwen_image), local_files_only=True)
    pipe.load_lora_weights(str(path))
    assert sum(isinstance(m, LoraLayer) for m in pipe.transformer.modules()) == count
    theirs = prediction_with(family, pipe.transformer, 16)
    assert (ours - plain).abs().max() > 1e-3
    assert (ours - theirs).abs().max() < 1e-5


def test_the_run_says_diffusers_and_comfyui_skip_text_encoder_adapters(family):
    adapters = perturbed_adapters(family, ["text_encoder"], layer_preset="attn")
    try:
        said = format_warnings("diffusers", adapters, family)
        kohya = format_warnings("kohya", adapters, family)
    finally:
        adapters.unhook()
    assert any("ComfyUI will not load" in w for w in said)
    assert any("load_lora_weights will not load" in w and "model.parts.text_encoder.train" in w for w in kohya)


# ComfyUI's key map for Qwen-Image (comfy/lora.py, a fact reproduced independently): its model has
# diffusers' module names (comfy/ldm/qwen_image/model.py), and per weight `diffusion_model.<X>` it
# maps `lora_unet_<X with _>`, `diffusion_model.<X>`, and for QwenImage models `<X>`,
# `transformer.<X>`, `lycoris_<X with _>`; the lone Qwen2.5-VL's `qwen25_7b.transformer.model.<k>`
# only as `text_encoders.qwen25_7b.transformer.model.<k>` (no `lora_te_` name for it).
def _comfyui_qwen_image_map(family) -> set[str]:
    stems = set()
    for key in family.transformer.state_dict():
        if key.endswith(".weight"):
            x = key.removesuffix(".weight")
            stems |= {f"lora_unet_{x.replace('.', '_')}", f"diffusion_model.{x}", x, f"transformer.{x}",
                      f"lycoris_{x.replace('.', '_')}"}
    for key in family.parts["text_encoder"].state_dict():
        if key.endswith(".weight"):
            k = key.removesuffix(".weight")
            stems.add(f"text_encoders.qwen25_7b.transformer.model.{k}")
    return stems


@pytest.mark.parametrize("adapter", [{"type": "lora"}, {"type": "lokr"}], ids=["lora", "lokr"])
def test_every_kohya_and_comfy_stem_is_one_comfyui_maps(family, adapter):
    adapters = build_adapter_set(family, AdapterConfig(rank=2, layer_preset="all-linear", **adapter),
                                 ["transformer", "text_encoder"], torch.device("cpu"))
    try:
        comfyui = _comfyui_qwen_image_map(family)
        for fmt in ("kohya", "comfy"):
            stems = {re.sub(r"\.(lora_down\.weight|lora_up\.weight|alpha|lokr_\w+)$", "", k)
                     for k in file_state(adapters, family, fmt)}
            assert stems and not stems - comfyui, sorted(stems - comfyui)[:5]
    finally:
        adapters.unhook()


def test_the_transformer_runs_its_blocks_in_the_listed_order(family):
    from family_cross import blocks_run_in_listed_order

    assert family.checkpoint_blocks("transformer") == list(family.transformer.transformer_blocks)
    latents = torch.randn(1, 16, 8, 8)
    text = family.encode_text(family.tokenize(["a"]))
    blocks_run_in_listed_order(family, "transformer", lambda: family.denoise(latents, torch.tensor([0.5]), text))
    blocks_run_in_listed_order(family, "text_encoder", lambda: family.encode_text(family.tokenize(["a"])))


def test_the_single_transformer_file_loads_the_folders_tensors(tmp_path, tiny_qwen_image, shape_images, family):
    """ComfyUI's qwen_image_*.safetensors: the transformer under model.diffusion_model., diffusers' names;
    the text encoder and VAE from folders."""
    from safetensors.torch import load_file, save_file

    from modules.model.detect import detect_family
    from modules.model.qwen_image import QwenImageFamily

    folder = load_file(str(next((tiny_qwen_image / "transformer").glob("*.safetensors"))))
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in folder.items()},
              str(tmp_path / "qwen_image.safetensors"))
    assert detect_family(tmp_path / "qwen_image.safetensors") == "qwen_image"
    assert detect_family(tiny_qwen_image) == "qwen_image"
    config = train_config(tmp_path / "qwen_image.safetensors", shape_images, tmp_path, {"model": {
        "family": "qwen_image", "parts": {"text_encoder": {"path": str(tiny_qwen_image / "text_encoder")},
                                          "vae": {"path": str(tiny_qwen_image / "vae")}}}})
    from_file = QwenImageFamily(config)
    from_file.model_configs_dir = tiny_qwen_image  # the tiny model's part configs
    from_file.load()
    ours, theirs = from_file.transformer.state_dict(), family.transformer.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_sample_runs_true_cfg_from_the_live_modules(family, monkeypatch):
    from diffusers import QwenImageTransformer2DModel

    from modules.config.train_config import SamplePromptConfig

    calls = []
    forward = QwenImageTransformer2DModel.forward
    monkeypatch.setattr(QwenImageTransformer2DModel, "forward",
                        lambda self, *a, **k: calls.append(k["encoder_hidden_states_mask"]) or forward(self, *a, **k))
    prompt = SamplePromptConfig(prompt="a red circle", steps=2, cfg=3.0, width=64, height=64, seed=3)
    image = family.sample(prompt, torch.device("cpu"))
    assert image.size == (64, 64)
    assert image.getextrema() != ((0, 0), (0, 0), (0, 0))
    assert len(calls) == 4  # two steps, each with the prompt and the (empty) negative prompt
    assert all(mask is not None and not mask.all() for mask in calls)  # padding masked while sampling too


@pytest.mark.parametrize("mode", ["float8", "nf4"])
def test_a_quantized_transformer_trains(tmp_path, tiny_qwen_image, one_image, mode):
    from family_cross import initializes_and_steps

    initializes_and_steps(tiny_qwen_image, one_image, tmp_path, "qwen_image", "transformer", mode, dora=False)


def test_offloading_half_the_transformer_trains_the_same_adapter(fake_device, tmp_path, tiny_qwen_image, one_image):
    from family_cross import offloaded_training_matches

    offloaded_training_matches(tiny_qwen_image, one_image, tmp_path, "qwen_image", "transformer", fake_device)


def test_a_fine_tune_freezes_the_last_blocks_text_stream_and_trains(tmp_path, tiny_qwen_image, one_image):
    """The last block's text queries, text attention output and text MLP reach no loss: a fine-tune
    leaves them frozen (the first-step guard would stop the run otherwise) and trains the rest."""
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_qwen_image, one_image, tmp_path, {
        "model": {"family": "qwen_image", "parts": {"transformer": {"weight_dtype": "float32"}}},
        "method": {"type": "fine_tune", "save_format": "diffusers"}, "optimizer": {"lr": 1e-4},
        "schedule": {"max_steps": 1, "batch_size": 1}})
    trainer = GenericTrainer(config)
    trainer.start()
    trainer.train()  # the guard checks every trainable weight moved
    blocks = trainer.family.transformer.transformer_blocks
    assert trainer.step == 1
    assert not blocks[-1].txt_mlp.net[2].weight.requires_grad and not blocks[-1].attn.add_q_proj.weight.requires_grad
    assert blocks[-1].attn.add_k_proj.weight.requires_grad and blocks[0].txt_mlp.net[2].weight.requires_grad


def test_a_skeleton_transformer_leaves_the_load_unchanged(family):
    loads_beside_a_skeleton_denoiser(family)  # what `launch.py cache` loads
