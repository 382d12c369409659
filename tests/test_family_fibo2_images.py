"""FIBO-2 with the images Qwen3-VL sees, on the tiny model: editing (BriaFibo2Pipeline(image=...)) on
edit pairs and a caption's `text_render` texts drawn as images. The encodings are the pipeline's
own (its processor's image tokens, its edit prompt, its marked text entries), a generation reads
the caption without its text images above noise level 0.9 as the pipeline's loop does, a caption
without text to render is encoded as before, samples are the pipeline's own images, a LoRA on pairs
trains (the loss falls) with the control reaching the transformer, and resume on pairs equals an
uninterrupted run."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import resumed_training_matches

from modules.data.synthetic_images import write_edit_pairs

FIBO2 = {"model": {"family": "fibo2"}}
TEXT_CAPTION = json.dumps({"short_description": "a shop sign", "text_render": [
    {"text": "OPEN", "location": "center"}, {"text": "", "location": "top"}, {"text": "24/7 Café"}]})


@pytest.fixture(scope="session")
def tiny_fibo2(tiny_family_model):
    return tiny_family_model("fibo2")  # the session's, shared with tests/test_family_fibo2.py


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_fibo2, shape_images):
    from modules.model.fibo2 import Fibo2Family

    family = Fibo2Family(train_config(tiny_fibo2, shape_images, tmp_path_factory.mktemp("fibo2-images"), FIBO2))
    family.load()
    return family


@pytest.fixture(scope="module")
def pipe(tiny_fibo2, family):
    """The released pipeline on the tiny folder with its Qwen3VLProcessor made of the folder's tokenizer
    and image processor (its class check wants torchvision's video processor, absent here: the
    processor's own __call__ runs unchanged)."""
    from diffusers import BriaFibo2Pipeline
    from transformers import ProcessorMixin, Qwen3VLProcessor

    pipe = BriaFibo2Pipeline.from_pretrained(str(tiny_fibo2), processor=None, local_files_only=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
        pipe.processor = Qwen3VLProcessor(image_processor=family.image_processor, tokenizer=family.tokenizer,
                                          video_processor=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fibo2-pairs")
    write_edit_pairs(folder, count=2)
    return folder


def _open(path):
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def _paired(folder) -> dict:
    return {**FIBO2, "concepts": [{"path": str(folder), "controls": {"source": "folders"}}]}


def _real(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return hidden[:, :, :int(mask[0].sum())]


def test_the_pipelines_image_settings_are_the_familys(pipe):
    from modules.model.fibo2 import TEXT_ENCODER_IMAGE_SIZE, TEXT_IMAGES_MAX_NOISE_LEVEL

    assert pipe.text_encoder_image_size == TEXT_ENCODER_IMAGE_SIZE
    assert pipe.text_images_max_noise_level == TEXT_IMAGES_MAX_NOISE_LEVEL


@pytest.mark.parametrize("prompt", ["make the circle red",
                                    json.dumps({"edit_instruction": "make it red", "short_description": "a circle"}),
                                    json.dumps({"edit_instruction": "write on it", "structured_caption": {
                                        "short_description": "a sign", "text_render": [{"text": "HI"}]}})],
                         ids=["instruction", "caption", "text-render"])
def test_an_edit_encodes_as_the_pipeline_encodes_it(family, pipe, pairs, prompt):
    """The edit prompt with the image's marker and, for a caption with text, its text images after it."""
    from diffusers import BriaFibo2Pipeline

    from modules.model.fibo2 import text_images

    control = _open(pairs / "control" / "000.png")
    drawn = text_images(BriaFibo2Pipeline._parse_prompt(prompt)[0])
    with torch.no_grad():
        theirs, _ = pipe.encode_prompt(prompt, image=[control], device=torch.device("cpu"),
                                       text_images=drawn or None)
        tokens = family.tokenize([prompt], [[control]])
        ours = family.encode_text(tokens)
    assert int((tokens["mm_token_type_ids"] == 1).sum()) == sum(
        int(g.prod()) // 4 for g in tokens["image_grid_thw"]) and len(tokens["image_grid_thw"]) == 1 + len(drawn)
    assert int(ours["attention_mask"][0].sum()) == theirs.shape[2]
    torch.testing.assert_close(_real(ours["hidden_states"], ours["attention_mask"]), theirs, atol=1e-5, rtol=0)
    assert not ours["base_attention_mask"].any()  # an edit shows its text images at every step


def test_a_generation_reads_its_text_images_below_noise_level_0_9_as_the_pipeline_does(family, pipe):
    """What the pipeline's transformer reads at each step of a generation with text to render (its own
    drawings of the caption's texts, the characters the built-in font lacks included) is what denoise
    picks at that sigma from the family's two encodings of the caption."""
    seen = []

    def record(module, args, kwargs):
        seen.append((float(kwargs["timestep"][0]), kwargs["encoder_hidden_states"]))

    hook = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        pipe(prompt=TEXT_CAPTION, num_inference_steps=6, guidance_scale=1.0, width=64, height=64,
             generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    tokens = family.tokenize([TEXT_CAPTION])
    assert tokens["image_grid_thw"].shape[0] == 2  # "OPEN" and "24/7 Café"; the empty text gets none
    with torch.no_grad():
        text = family.encode_text(tokens)
    assert (text["hidden_states"] - text["base_hidden_states"]).abs().max() > 1e-3
    regimes = set()
    for sigma, theirs in seen:
        hidden, mask = family._conditioning_at(torch.tensor([sigma]), text)
        assert int(mask[0].sum()) == theirs.shape[2], sigma
        torch.testing.assert_close(_real(hidden, mask), theirs, atol=1e-5, rtol=0)
        regimes.add(sigma <= 0.9)
    assert regimes == {False, True}, [s for s, _ in seen]


@pytest.mark.parametrize("caption", ["a red circle", json.dumps({"short_description": "a red circle"}),
                                     json.dumps({"short_description": "a wall", "text_render": [{"text": ""}]})],
                         ids=["text", "json", "no-text"])
def test_a_caption_without_text_to_render_is_encoded_as_before(family, pipe, caption):
    from modules.model.fibo2 import trained_caption

    tokens = family.tokenize([caption])
    assert "pixel_values" not in tokens and not tokens["base_attention_mask"].any()
    with torch.no_grad():
        text = family.encode_text(tokens)
        theirs, _ = pipe.encode_prompt(trained_caption(caption), device=torch.device("cpu"))
    for sigma in (1.0, 0.5):
        hidden, mask = family._conditioning_at(torch.tensor([sigma]), text)
        assert hidden is text["hidden_states"]
        torch.testing.assert_close(_real(hidden, mask), theirs, atol=1e-6, rtol=0)


def _pixels(image) -> torch.Tensor:
    return torch.tensor(list(image.getdata()), dtype=torch.float32)


def _same_image(ours, theirs):
    # up to float rounding (the family encodes in a padded window, the pipeline unpadded)
    difference = (_pixels(ours) - _pixels(theirs)).abs()
    assert difference.max() <= 1 and difference.mean() < 0.01, (difference.max(), difference.mean())


def test_a_sample_with_text_to_render_is_the_pipelines_own_image(family, pipe):
    from modules.config.train_config import SamplePromptConfig

    prompt = SamplePromptConfig(prompt=TEXT_CAPTION, steps=3, cfg=3.0, width=64, height=64, seed=3)
    ours = family.sample(prompt, torch.device("cpu"))
    theirs = pipe(prompt=TEXT_CAPTION, num_inference_steps=3, guidance_scale=3.0, width=64, height=64,
                  generator=torch.Generator().manual_seed(3)).images[0]
    without = pipe(prompt=TEXT_CAPTION, num_inference_steps=3, guidance_scale=3.0, width=64, height=64,
                   generator=torch.Generator().manual_seed(3), render_text_images=False).images[0]
    _same_image(ours, theirs)
    assert ours.tobytes() != without.tobytes()  # the text images are there


def test_an_edit_sample_is_the_pipelines_own_edit_and_follows_its_control(family, pipe, pairs):
    from modules.config.train_config import SamplePromptConfig

    first, second = sorted((pairs / "control").glob("*.png"))

    def ours(control):
        return family.sample(SamplePromptConfig(prompt="make the circle red", steps=2, cfg=2.5, width=64, height=64,
                                                seed=3, control_images=[str(control)]), torch.device("cpu"))

    theirs = pipe(prompt="make the circle red", image=_open(first), num_inference_steps=2, guidance_scale=2.5,
                  width=64, height=64, generator=torch.Generator().manual_seed(3)).images[0]
    edited = ours(first)
    _same_image(edited, theirs)
    assert (_pixels(edited) - _pixels(ours(second))).abs().max() > 0


def test_the_image_to_edit_reaches_the_transformer_as_its_context(family):
    latents = torch.randn(1, 8, 8, 8, generator=torch.Generator().manual_seed(0))
    control = torch.randn(1, 1, 8, 8, 8, generator=torch.Generator().manual_seed(1))
    text = family.encode_text(family.tokenize(["make it red"]))
    with torch.no_grad():
        edited = family.denoise(latents, torch.tensor([0.5]), {**text, "control_latents": control})
        theirs = family.transformer(hidden_states=latents, timestep=torch.tensor([0.5]),
                                    encoder_hidden_states=text["hidden_states"],
                                    encoder_attention_mask=text["attention_mask"].bool(),
                                    context_latents=[control[:, 0]], return_dict=False)[0]
        other = family.denoise(latents, torch.tensor([0.5]), {**text, "control_latents": control.flip(-1)})
        plain = family.denoise(latents, torch.tensor([0.5]), text)
    torch.testing.assert_close(edited, theirs, atol=1e-6, rtol=0)
    assert (edited - other).abs().max() > 1e-3 and (edited - plain).abs().max() > 1e-3


def test_fibo2_trains_a_lora_on_pairs_with_the_text_cached_per_control(tmp_path, tiny_fibo2, pairs):
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_fibo2, pairs, tmp_path, _paired(pairs), {
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 12, "batch_size": 1},
        "optimizer": {"lr": 1e-2}})
    trainer = GenericTrainer(config)
    trainer.start()
    entries = trainer.dataset.entries
    texts = trainer.dataset.texts
    family = trainer.family
    for entry in entries:  # each caption's conditioning is the encoding of it with its own control (64 px: the bucket)
        stored = texts[entry.text_key]
        with torch.no_grad():
            fresh = family.encode_text(family.tokenize([entry.item.caption], [[_open(entry.item.controls[0])]]))
        real = int(fresh["attention_mask"][0].sum())
        assert int(stored["attention_mask"].sum()) == real > int(family.tokenize([entry.item.caption])[
            "attention_mask"].sum())
        torch.testing.assert_close(stored["hidden_states"][:, :real], fresh["hidden_states"][0, :, :real],
                                   atol=1e-5, rtol=0)
    assert trainer.dataset.collate([0], trainer.device).controls.shape == (1, 1, 8, 32, 32)
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter learned
    after = fixed_loss(trainer, draws=8)
    trainer.end()
    assert after < before * 0.8, (before, after)


def test_resume_on_pairs_equals_an_uninterrupted_run(tmp_path, tiny_fibo2, pairs):
    resumed_training_matches(tiny_fibo2, pairs, tmp_path, "fibo2", _paired(pairs))


def test_an_edit_caption_that_is_a_json_object_needs_an_edit_instruction(family, pairs):
    from modules.errors import UserError

    with pytest.raises(UserError, match=r'FIBO-2: an edit pair.s caption .* needs an "edit_instruction" key'):
        family.tokenize([json.dumps({"short_description": "a red circle"})], [[_open(pairs / "control" / "000.png")]])


def test_a_trained_qwen3_vl_on_pairs_trains_encoding_each_step_with_the_control(tmp_path, tiny_fibo2, pairs):
    """Each pair's conditioning depends on its control: with Qwen3-VL trained nothing is cached, and the
    step encodes the caption with the sample's control (Batch.text_controls), so the first step's guard
    sees every adapter learn."""
    import math

    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_fibo2, pairs, tmp_path, _paired(pairs), {
        "model": {"parts": {"text_encoder": {"train": True}}}, "schedule": {"max_steps": 2, "batch_size": 1}})
    trainer = GenericTrainer(config)
    trainer.start()
    trainer.train()
    assert trainer.step == 2 and math.isfinite(trainer.last_loss)
    assert trainer.dataset.cache_stats["text"] == (0, 0)
    assert trainer.dataset.collate([0], trainer.device).text_controls is not None
    assert any(name.startswith("lora_te_") for name, _ in trainer.methods[0].named_parameters())


def test_a_batch_of_captions_with_and_without_text_to_render_encodes_each_as_alone(family):
    with torch.no_grad():
        batch = family.encode_text(family.tokenize([TEXT_CAPTION, "a red circle"]))
        alone = [family.encode_text(family.tokenize([caption])) for caption in (TEXT_CAPTION, "a red circle")]
    assert batch["base_attention_mask"][0].any() and not batch["base_attention_mask"][1].any()
    for row, single in enumerate(alone):
        for name, mask in (("hidden_states", "attention_mask"), ("base_hidden_states", "base_attention_mask")):
            assert torch.equal(batch[mask][row], single[mask][0])
            real = batch[mask][row].bool()
            torch.testing.assert_close(batch[name][row][:, real], single[name][0][:, real], atol=1e-5, rtol=0)


def test_a_caption_with_text_to_render_trains_with_both_encodings_cached(tmp_path, tiny_fibo2, one_image):
    import shutil

    from modules.trainer.generic_trainer import GenericTrainer

    images = tmp_path / "images"
    shutil.copytree(one_image, images)
    next(images.glob("*.txt")).write_text(TEXT_CAPTION, encoding="utf-8")
    config = train_config(tiny_fibo2, images, tmp_path / "run", FIBO2, {"schedule": {"epochs": 2, "batch_size": 1}})
    trainer = GenericTrainer(config)
    trainer.start()
    (entry,) = trainer.dataset.entries
    stored = trainer.dataset.texts[entry.text_key]
    with torch.no_grad():
        fresh = trainer.family.encode_text(trainer.family.tokenize([TEXT_CAPTION]))
    for name, mask in (("hidden_states", "attention_mask"), ("base_hidden_states", "base_attention_mask")):
        real = fresh[mask][0].bool()
        assert torch.equal(stored[mask].bool(), real) and real.any()
        torch.testing.assert_close(stored[name][:, real], fresh[name][0][:, real], atol=1e-5, rtol=0)
    trainer.train()  # the first step's guard checks every adapter learned
    trainer.end()
