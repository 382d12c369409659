"""Qwen-Image-Edit and Qwen-Image-Edit-Plus (2509/2511) on tiny offline models, trained on edit pairs:
the VL encoder sees the control images as the pipelines' encode_prompt shows them (template, image
tokens, 64 dropped), the text cache keys on the controls (and a mirrored pair has its own encoding),
the controls' latents join the sequence as the pipelines put them with their img_shapes and only the
target is predicted, a trained text encoder encodes each step's caption with its controls, the loss falls (Edit on one control, Plus on two), resumed, half-offloaded and
fp8/nf4 runs on pairs work as plain ones, a different control changes the sample, the files load in
QwenImageEditPipeline / QwenImageEditPlusPipeline.load_lora_weights with every adapter used and equal
outputs, and every saved stem is one ComfyUI maps (its Qwen-Image map: ComfyUI runs both edit models
as its QwenImage model)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import (
    initializes_and_steps,
    offloaded_training_matches,
    perturbed_adapters,
    prediction_with,
    resumed_training_matches,
)
from test_family_qwen_image import _comfyui_qwen_image_map

from modules.adapters.formats.files import file_state, save_adapter_file
from modules.config.loading import build_config
from modules.config.presets import list_presets, load_preset_overlay
from modules.data.synthetic_images import write_edit_pairs
from modules.trainer.generic_trainer import GenericTrainer

EDIT = {"model": {"family": "qwen_image_edit"}}
PLUS = {"model": {"family": "qwen_image_edit_plus"}}


@pytest.fixture(scope="session")
def tiny_edit(tiny_family_model):
    return tiny_family_model("qwen_image_edit")


@pytest.fixture(scope="session")
def tiny_plus(tiny_family_model):
    return tiny_family_model("qwen_image_edit_plus", variant="2511")  # zero_cond_t


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("edit-pairs")
    write_edit_pairs(folder, count=2)
    return folder


@pytest.fixture(scope="module")
def one_caption_pairs(tmp_path_factory):
    """Two pairs with one instruction: only their control images tell their conditionings apart."""
    folder = tmp_path_factory.mktemp("edit-pairs-one-caption")
    for target in write_edit_pairs(folder, count=2):
        target.with_suffix(".txt").write_text("make it red", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def two_control_pairs(pairs, tmp_path_factory):
    """The pairs with a second control folder (control_2/: the first control mirrored)."""
    import shutil

    from PIL import ImageOps

    folder = tmp_path_factory.mktemp("edit-pairs-2")
    shutil.copytree(pairs / "target", folder / "target")
    shutil.copytree(pairs / "control", folder / "control")
    (folder / "control_2").mkdir()
    for path in (pairs / "control").glob("*.png"):
        ImageOps.mirror(ImageOps.grayscale(_open(path)).convert("RGB")).save(folder / "control_2" / path.name)
    return folder


def _open(path):
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def paired(family: dict, folder) -> dict:
    return {**family, "concepts": [{"path": str(folder), "controls": {"source": "folders"}}]}


@pytest.fixture(scope="module")
def edit(tmp_path_factory, tiny_edit, shape_images):
    from modules.model.qwen_image_edit import QwenImageEditFamily

    family = QwenImageEditFamily(train_config(tiny_edit, shape_images, tmp_path_factory.mktemp("edit"), EDIT))
    family.load()
    return family


@pytest.fixture(scope="module")
def plus(tmp_path_factory, tiny_plus, shape_images):
    from modules.model.qwen_image_edit_plus import QwenImageEditPlusFamily

    family = QwenImageEditPlusFamily(train_config(tiny_plus, shape_images, tmp_path_factory.mktemp("plus"), PLUS))
    family.load()
    return family


def _controls(seed: int, count: int = 1) -> torch.Tensor:
    return torch.randn(1, count, 16, 8, 8, generator=torch.Generator().manual_seed(seed))


def test_the_folders_are_detected_as_edit_and_plus(tiny_edit, tiny_plus):
    from modules.model.detect import detect_family

    assert detect_family(tiny_edit) == "qwen_image_edit"
    assert detect_family(tiny_plus) == "qwen_image_edit_plus"


def test_edit_trains_a_lora_on_pairs_with_the_text_cached_per_control(tmp_path, tiny_edit, one_caption_pairs):
    pairs = one_caption_pairs
    config = train_config(tiny_edit, pairs, tmp_path, paired(EDIT, pairs), {
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 6, "batch_size": 1},
        "optimizer": {"lr": 1e-2}, "data": {"flip": True}})
    trainer = GenericTrainer(config)
    trainer.start()
    entries = trainer.dataset.entries
    # one caption, two controls: one encoding per (caption, controls, bucket), one more of each mirrored control
    keys = {k for e in entries for k in (e.text_key, e.flipped_text_key)}
    assert len(keys) == 4 and None not in keys
    texts = trainer.dataset.texts
    plain, mirrored = texts[entries[0].text_key], texts[entries[0].flipped_text_key]
    assert (plain["hidden_states"] - texts[entries[1].text_key]["hidden_states"]).abs().max() > 1e-4
    # the image block: vision start, a 64 px control's pads (56 px after Qwen2-VL's resize: 4 x 4 patches
    # merged 2 x 2) and vision end, then the caption's window
    assert plain["attention_mask"].shape == (1 + 4 + 1 + trainer.family.max_sequence_length,)
    assert (plain["hidden_states"] - mirrored["hidden_states"]).abs().max() > 1e-4  # the VL saw the mirror
    assert trainer.dataset.collate([0], trainer.device).controls.shape == (1, 1, 16, 16, 16)
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter learned
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert after < before * 0.8, (before, after)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        assert any(k.startswith("lora_unet_transformer_blocks_0_attn_to_q.") for k in file.keys())  # noqa: SIM118 (safe_open is no dict)
        assert file.metadata()["modelspec.architecture"] == "qwen-image-edit/lora"
    # a second run finds every text entry (and latent) in the cache
    again = GenericTrainer(config)
    again.start()
    assert again.dataset.cache_stats["text"] == (4, 0)


def test_plus_trains_on_two_controls_each_shown_as_a_picture_and_the_loss_falls(tmp_path, tiny_plus,
                                                                                 two_control_pairs):
    config = train_config(tiny_plus, two_control_pairs, tmp_path, paired(PLUS, two_control_pairs), {
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 10, "batch_size": 1},
        "optimizer": {"lr": 1e-2}})
    trainer = GenericTrainer(config)
    trainer.start()
    batch = trainer.dataset.collate([0, 1], trainer.device)
    assert batch.controls.shape == (2, 2, 16, 16, 16)
    # "Picture N: " (a token per character here), vision start, the pads of a 64 px control shown at the
    # pipeline's ~384 px condition size (392 px after Qwen2-VL's resize: 28 x 28 patches merged 2 x 2), vision end
    picture = len("Picture 1: ") + 1 + 196 + 1
    assert batch.text["attention_mask"].shape[1] == 2 * picture + trainer.family.max_sequence_length
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter learned
    after = fixed_loss(trainer, draws=8)
    trainer.end()
    assert after < before * 0.8, (before, after)


def _paired_run(which: str, request) -> tuple:
    """(tiny model, pairs, overlay): Edit on one control per target, Plus on two."""
    if which == "edit":
        pairs = request.getfixturevalue("pairs")
        return request.getfixturevalue("tiny_edit"), pairs, paired(EDIT, pairs)
    pairs = request.getfixturevalue("two_control_pairs")
    return request.getfixturevalue("tiny_plus"), pairs, paired(PLUS, pairs)


@pytest.mark.parametrize("which", ["edit", "plus"])
def test_resume_on_pairs_equals_an_uninterrupted_run(which, request, tmp_path):
    model, pairs, overlay = _paired_run(which, request)
    resumed_training_matches(model, pairs, tmp_path, overlay["model"]["family"], overlay)


@pytest.mark.parametrize("which", ["edit", "plus"])
def test_offloading_half_the_transformer_trains_the_same_adapter_on_pairs(which, request, fake_device, tmp_path):
    model, pairs, overlay = _paired_run(which, request)
    offloaded_training_matches(model, pairs, tmp_path, overlay["model"]["family"], "transformer", fake_device,
                               overlay)


@pytest.mark.parametrize("mode", ["float8", "nf4"])
@pytest.mark.parametrize("which", ["edit", "plus"])
def test_a_quantized_transformer_trains_on_pairs(which, mode, request, tmp_path):
    model, pairs, overlay = _paired_run(which, request)
    initializes_and_steps(model, pairs, tmp_path, overlay["model"]["family"], "transformer", mode, False, overlay)


def test_a_trained_text_encoder_on_pairs_trains_encoding_each_step_with_the_controls(tmp_path, tiny_edit, pairs):
    """The conditioning is encoded in the step (nothing cached) from the caption and the sample's control
    images, so LoRA on Qwen2.5-VL trains on pairs: the first step's guard sees every adapter learn."""
    import math

    config = train_config(tiny_edit, pairs, tmp_path, paired(EDIT, pairs), {
        "model": {"parts": {"text_encoder": {"train": True}}}, "adapter": {"layer_preset": "attn-mlp"},
        "schedule": {"max_steps": 2, "batch_size": 1}})
    trainer = GenericTrainer(config)
    trainer.start()
    trainer.train()
    assert trainer.step == 2 and math.isfinite(trainer.last_loss)
    assert trainer.dataset.cache_stats["text"] == (0, 0)
    assert trainer.dataset.collate([0], trainer.device).text_controls is not None
    assert any(name.startswith("lora_te_language_model_") for name, _ in trainer.methods[0].named_parameters())


def _processor(family, monkeypatch):
    """The pipelines' Qwen2VLProcessor from the family's tokenizer and image processor (its class check
    wants torchvision's video processor, absent here: the processor's own __call__ runs unchanged)."""
    from transformers import ProcessorMixin, Qwen2VLProcessor

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    return Qwen2VLProcessor(image_processor=family.image_processor, tokenizer=family.tokenizer)


@pytest.mark.parametrize("which", ["edit", "plus"])
def test_encodings_equal_the_pipelines_encode_prompt(which, request, pairs, monkeypatch):
    from modules.model.qwen_image_edit import open_control

    family = request.getfixturevalue(which)
    count = 1 if which == "edit" else 2
    images = [open_control(pairs / "control" / f"00{i}.png", 64, 64) for i in range(count)]
    pipe = family.pipeline()
    pipe.processor = _processor(family, monkeypatch)
    shown = images[0] if which == "edit" else family.vl_images(images)  # Plus resizes before encode_prompt
    prompt = "make the circle red"
    with torch.no_grad():
        theirs, _ = pipe.encode_prompt(prompt, image=shown, device="cpu")
        ours = family.encode_text(family.tokenize([prompt], [images]))
    length = theirs.shape[1]
    assert ours["attention_mask"][0].sum() == length
    torch.testing.assert_close(ours["hidden_states"][:, :length], theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("which", ["edit", "plus"])
def test_controls_are_packed_and_placed_as_the_pipeline_places_them(which, request):
    """Our denoise is the pipeline's transformer call on [target, controls] with its img_shapes (given
    the control latents the pipeline's prepare_latents packs), cut back to the target's tokens."""
    from modules.model.flux import pack_latents, unpack_latents

    family = request.getfixturevalue(which)
    count = 1 if which == "edit" else 2
    pipe = family.pipeline()
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(2))
    controls = torch.randn(1, count, 16, 8, 12, generator=torch.Generator().manual_seed(3))
    given = [controls[:, i].unsqueeze(2) for i in range(count)]
    scale = pipe.vae_scale_factor
    _, packed = pipe.prepare_latents(given if which == "plus" else given[0], 1, 16, 8 * scale, 8 * scale,
                                     torch.float32, torch.device("cpu"), torch.Generator().manual_seed(1))
    text = family.encode_text(family.tokenize(["make the circle red"]))
    with torch.no_grad():
        ours = family.denoise(latents, torch.tensor([0.5]), {**text, "control_latents": controls})
        out = pipe.transformer(
            hidden_states=torch.cat([pack_latents(latents), packed], dim=1), timestep=torch.tensor([0.5]),
            encoder_hidden_states=text["hidden_states"], encoder_hidden_states_mask=text["attention_mask"].bool(),
            img_shapes=[[(1, 4, 4)] + [(1, 4, 6)] * count], return_dict=False)[0]
        plain = family.denoise(latents, torch.tensor([0.5]), text)
        other = family.denoise(latents, torch.tensor([0.5]), {**text, "control_latents": controls.flip(-1)})
    assert ours.shape == latents.shape
    torch.testing.assert_close(ours, unpack_latents(out[:, :16], 8, 8), atol=1e-6, rtol=0)
    assert (ours - plain).abs().max() > 1e-3 and (ours - other).abs().max() > 1e-3


def test_samples_follow_their_control_images(edit, plus, pairs, two_control_pairs):
    from modules.config.train_config import SamplePromptConfig

    def sample(family, controls):
        prompt = SamplePromptConfig(prompt="make the circle red", steps=2, cfg=2.5, width=64, height=64, seed=3,
                                    control_images=[str(c) for c in controls])
        return torch.tensor(list(family.sample(prompt, torch.device("cpu")).getdata()), dtype=torch.float32)

    first, second = sorted((pairs / "control").glob("*.png"))
    a, again, b, none = sample(edit, [first]), sample(edit, [first]), sample(edit, [second]), sample(edit, [])
    assert torch.equal(a, again)
    assert (a - b).abs().max() > 0 and (a - none).abs().max() > 0
    extra = two_control_pairs / "control_2" / first.name
    one, both = sample(plus, [first]), sample(plus, [first, extra])
    assert (one - both).abs().max() > 0


@pytest.mark.parametrize("which", ["edit", "plus"])
def test_load_lora_weights_loads_every_adapter_and_matches_the_hooked_model(which, request, tmp_path):
    import diffusers
    from peft.tuners.lora import LoraLayer

    family = request.getfixturevalue(which)
    folder = request.getfixturevalue("tiny_edit" if which == "edit" else "tiny_plus")
    adapters = perturbed_adapters(family, ["transformer"], layer_preset="all-linear")
    try:
        path = tmp_path / f"{which}.safetensors"
        save_adapter_file(path, adapters, family, "diffusers", torch.float32, {})
        ours, count = prediction_with(family, family.transformer, 16), len(adapters)
    finally:
        adapters.unhook()
    plain = prediction_with(family, family.transformer, 16)
    cls = getattr(diffusers, family.pipeline_classes[0])
    pipe = cls.from_pretrained(str(folder), processor=None, local_files_only=True)  # (its processor needs torchvision)
    pipe.load_lora_weights(str(path))
    assert sum(isinstance(m, LoraLayer) for m in pipe.transformer.modules()) == count  # no key dropped
    theirs = prediction_with(family, pipe.transformer, 16)
    assert (ours - plain).abs().max() > 1e-3
    assert (ours - theirs).abs().max() < 1e-5


def test_every_kohya_and_comfy_stem_is_one_comfyui_maps(edit):
    adapters = perturbed_adapters(edit, ["transformer"], layer_preset="all-linear")
    try:
        comfyui = _comfyui_qwen_image_map(edit)
        for fmt in ("kohya", "comfy"):
            stems = {re.sub(r"\.(lora_down\.weight|lora_up\.weight|alpha)$", "", k)
                     for k in file_state(adapters, edit, fmt)}
            assert stems and not stems - comfyui, sorted(stems - comfyui)[:5]
    finally:
        adapters.unhook()


def test_edit_presets_are_listed_and_valid():
    names = sorted(p.name for p in list_presets() if p.family == "qwen_image_edit")
    assert names == ["Qwen-Image-Edit LoRA 16GB", "Qwen-Image-Edit LoRA 24GB", "Qwen-Image-Edit embedding 8GB",
                     "Qwen-Image-Edit full fine-tune 12GB"]
    plus = sorted(p.name for p in list_presets() if p.family == "qwen_image_edit_plus")
    assert plus == ["Qwen-Image-Edit-Plus LoRA 16GB", "Qwen-Image-Edit-Plus LoRA 24GB",
                    "Qwen-Image-Edit-Plus embedding 8GB"]
    for name in names + plus:
        config = build_config([load_preset_overlay(name)])
        assert config.model.family in ("qwen_image_edit", "qwen_image_edit_plus")
        assert config.model.parts["transformer"].gradient_checkpointing
        assert not config.model.parts["text_encoder"].train
