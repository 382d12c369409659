"""Data options: caption variation, loss masks, concept balancing by samples per epoch, several
resolutions, and the cache keys each of them changes."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from conftest import train_config
from PIL import Image

from modules.config.loading import build_config
from modules.data.captions import fixed_caption, varied_caption
from modules.data.dataset import prepare_dataset
from modules.model.noise import Prediction
from modules.model.sd15 import SD15Family
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from modules.trainer.loss import training_loss


def _captions(**options):
    return build_config([{"concepts": [{"path": ".", "captions": options}]}]).concepts[0].captions


def test_caption_variations():
    caption = "sks dog, red collar, grass, sunny, park"
    assert fixed_caption("a dog", _captions(prefix="sks, ", suffix=", photo")) == "sks, a dog, photo"
    assert varied_caption(caption, _captions(), random.Random(0)) == caption  # nothing varies
    shuffled = {varied_caption(caption, _captions(shuffle_tags=True, keep_tags=1), random.Random(i))
                for i in range(20)}
    assert len(shuffled) > 5 and all(c.startswith("sks dog, ") for c in shuffled)
    assert all(sorted(c.split(", ")) == sorted(caption.split(", ")) for c in shuffled)
    dropped = [varied_caption(caption, _captions(tag_dropout=0.5, keep_tags=1), random.Random(i)) for i in range(50)]
    assert all(c.startswith("sks dog") for c in dropped) and min(len(c) for c in dropped) < len(caption)
    assert varied_caption(caption, _captions(caption_dropout=1.0), random.Random(0)) == ""


@pytest.fixture
def concept(tmp_path, shape_images):
    folder = tmp_path / "concept"
    shutil.copytree(shape_images, folder)
    return folder


def _dataset(tmp_path, model, concept_options, data=None, cache_text=True):
    config = train_config(model, tmp_path, tmp_path, {"concepts": [{"path": str(concept_options.pop("path")),
                                                                    **concept_options}], "data": data or {}})
    family = SD15Family(config)
    family.load()
    return prepare_dataset(config, family, torch.device("cpu"), tmp_path / "cache", lambda m: None, cache_text), family


def test_varied_captions_are_drawn_per_epoch_and_batch_and_repeat_exactly(tmp_path, tiny_model, concept):
    for caption in concept.glob("*.txt"):
        caption.write_text("shape, red, blue, green, small, large")
    dataset, _ = _dataset(tmp_path, tiny_model, {"path": concept, "captions": {"shuffle_tags": True}},
                          cache_text=False)
    draw = [dataset.collate([0, 1], torch.device("cpu"), epoch, batch).captions for epoch in range(3) for batch in range(2)]
    assert len({tuple(c) for c in draw}) > 3
    assert dataset.collate([0, 1], torch.device("cpu"), 2, 1).captions == draw[5]  # same draw for a resume


def test_varying_captions_turn_text_caching_off_and_train(tmp_path, tiny_model, concept):
    config = train_config(tiny_model, concept, tmp_path, {
        "concepts": [{"path": str(concept), "captions": {"tag_dropout": 0.3, "prefix": "sks, "}}],
        "schedule": {"max_steps": 2},
    })
    trainer = GenericTrainer(config, TrainCallbacks())
    trainer.start()
    assert trainer.dataset.collate([0], trainer.device).text is None  # encoded as drawn
    assert all(e.item.caption.startswith("sks, ") for e in trainer.dataset.entries)
    trainer.train()
    assert trainer.step == 2


def test_masks_weight_the_loss_on_the_latent_grid(tmp_path, tiny_model, concept):
    image = sorted(concept.glob("*.png"))[0]
    width, height = Image.open(image).size
    mask = Image.new("L", (width, height), 0)
    mask.paste(255, (0, 0, width // 2, height))  # left half white
    mask.save(image.with_name(f"{image.stem}-masklabel.png"))
    dataset, _ = _dataset(tmp_path, tiny_model, {"path": concept, "masked_loss": True, "unmasked_weight": 0.25})
    index = next(i for i, e in enumerate(dataset.entries) if e.item.image == image)
    other = next(i for i, e in enumerate(dataset.entries) if e.item.image != image)
    batch = dataset.collate([index, other], torch.device("cpu"))
    weights = batch.masks
    assert weights.shape == (2, 1, *batch.latents.shape[-2:])
    assert torch.allclose(weights[0, 0, :, :2], torch.ones(1)) and torch.allclose(weights[0, 0, :, -2:], torch.tensor(0.25))
    assert torch.equal(weights[1], torch.ones_like(weights[1]))  # no mask file: full weight
    # a sample whose error sits only in the black half weighs 0.25 of one with it in the white half
    error_left, error_right = torch.zeros(1, 4, 4, 4), torch.zeros(1, 4, 4, 4)
    error_left[..., :2], error_right[..., 2:] = 1.0, 1.0
    mask = torch.cat([torch.ones(1, 1, 4, 2), torch.full((1, 1, 4, 2), 0.25)], dim=-1)
    left = training_loss(Prediction(error_left, torch.zeros_like(error_left)), build_config([{}]).loss, None, mask)
    right = training_loss(Prediction(error_right, torch.zeros_like(error_right)), build_config([{}]).loss, None, mask)
    assert right == pytest.approx(0.25 * left)


def test_cache_keys_follow_the_mask_file_and_the_fixed_caption(tmp_path, tiny_model, concept):
    image = sorted(concept.glob("*.png"))[0]
    Image.new("L", Image.open(image).size, 255).save(image.with_name(f"{image.stem}-masklabel.png"))
    first, _ = _dataset(tmp_path, tiny_model, {"path": concept, "masked_loss": True})
    Image.new("L", Image.open(image).size, 0).save(image.with_name(f"{image.stem}-masklabel.png"))
    second, _ = _dataset(tmp_path, tiny_model, {"path": concept, "masked_loss": True})
    assert second.cache_stats["latents"] == (3, 1)  # only the image whose mask changed is encoded again
    third, _ = _dataset(tmp_path, tiny_model, {"path": concept, "masked_loss": True, "captions": {"prefix": "sks "}})
    assert third.cache_stats["text"][1] == 4 and third.cache_stats["latents"] == (4, 0)


def test_samples_per_epoch_balances_a_concept_and_cycles_through_it(tmp_path, tiny_model, concept, one_image):
    config = train_config(tiny_model, concept, tmp_path, {
        "concepts": [{"path": str(concept), "samples_per_epoch": 2}, {"path": str(one_image), "repeats": 3}],
        "schedule": {"batch_size": 1},
    })
    family = SD15Family(config)
    family.load()
    dataset = prepare_dataset(config, family, torch.device("cpu"), tmp_path / "cache", lambda m: None, True)
    seen = []
    for epoch in range(4):
        indices = [i for batch in dataset.epoch_batches(epoch) for i in batch]
        by_concept = [dataset.entries[i].item.concept for i in indices]
        assert by_concept.count(0) == 2 and by_concept.count(1) == 3
        seen += [dataset.entries[i].item.image.name for i in indices if dataset.entries[i].item.concept == 0]
    # each pair of epochs covers all four images once: every image before any image twice
    assert len(set(seen[:4])) == 4 and len(set(seen[4:])) == 4
    assert dataset.epoch_batches(1) == dataset.epoch_batches(1)


def test_several_resolutions_train_each_image_at_each(tmp_path, tiny_model, concept):
    dataset, _ = _dataset(tmp_path, tiny_model, {"path": concept}, data={"resolution": [64, 128]})
    buckets = sorted({e.bucket for e in dataset.entries})
    assert len(dataset.entries) == 8 and buckets == [(64, 64), (128, 128)]
    assert {tuple(dataset.latents[e.latent_key].shape[-2:]) for e in dataset.entries} == {(32, 32), (64, 64)}


def test_flip_serves_the_mirrored_images_latents_half_of_the_time(tmp_path, tiny_model, concept):
    from modules.data.dataset import FLIPPED
    from modules.data.images import load_cropped

    dataset, family = _dataset(tmp_path, tiny_model, {"path": concept}, data={"flip": True})
    # a shape that is not mirror-symmetric (the circle is), so the two versions differ
    index = next(i for i, e in enumerate(dataset.entries)
                 if not torch.allclose(dataset.latents[e.latent_key], dataset.latents[e.latent_key + FLIPPED]))
    entry = dataset.entries[index]
    plain, mirrored = dataset.latents[entry.latent_key], dataset.latents[entry.latent_key + FLIPPED]
    with torch.no_grad():
        expected = family.encode_images(load_cropped(entry.item.image, *entry.bucket).flip(-1)[None]).float()[0]
    torch.testing.assert_close(mirrored, expected, atol=1e-5, rtol=0)
    drawn = [dataset.collate([index], torch.device("cpu"), 0, b).latents[0] for b in range(40)]
    flips = sum(torch.equal(d, mirrored) for d in drawn)
    assert 8 < flips < 32 and flips + sum(torch.equal(d, plain) for d in drawn) == 40
    again, _ = _dataset(tmp_path, tiny_model, {"path": concept}, data={"flip": True})
    assert again.cache_stats["latents"] == (4, 0)  # both versions come back from the cache


def test_pixel_jitter_needs_uncached_latents(tmp_path):
    from modules.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data\.color_jitter: changes the image each time .* data\.cache_latents to false"):
        build_config([{"data": {"color_jitter": 0.1}}])
    build_config([{"data": {"color_jitter": 0.1, "crop_jitter": True, "cache_latents": False}}])


def test_jittered_latents_are_encoded_per_draw_and_repeat_exactly(tmp_path, tiny_model, concept):
    wide = concept / "wide.png"
    Image.new("RGB", (128, 64), (200, 30, 30)).save(wide)
    (concept / "wide.txt").write_text("a wide red image")
    data = {"crop_jitter": True, "color_jitter": 0.2, "cache_latents": False, "aspect_buckets": False}
    dataset, _ = _dataset(tmp_path, tiny_model, {"path": concept}, data=data)
    assert dataset.cache_stats["latents"] == (0, 0) and dataset.latents == {}
    index = next(i for i, e in enumerate(dataset.entries) if e.item.image == wide)
    draws = [dataset.collate([index], torch.device("cpu"), epoch, 0).latents for epoch in range(4)]
    assert all(not torch.equal(draws[0], d) for d in draws[1:])
    assert torch.equal(dataset.collate([index], torch.device("cpu"), 2, 0).latents, draws[2])


def test_a_run_with_fresh_latents_and_every_data_option_trains(tmp_path, tiny_model, concept):
    image = sorted(concept.glob("*.png"))[1]
    Image.new("L", Image.open(image).size, 255).save(image.with_name(f"{image.stem}-masklabel.png"))
    config = train_config(tiny_model, concept, tmp_path, {
        "concepts": [{"path": str(concept), "masked_loss": True, "samples_per_epoch": 3,
                      "captions": {"shuffle_tags": True, "prefix": "sks, "}}],
        "data": {"resolution": [64, 128], "flip": True, "crop_jitter": True, "color_jitter": 0.1,
                 "cache_latents": False},
        "schedule": {"max_steps": 2},
    })
    trainer = GenericTrainer(config, TrainCallbacks())
    trainer.start()
    trainer.train()
    assert trainer.step == 2 and torch.isfinite(torch.tensor(trainer.last_loss))


def test_batches_carry_each_images_original_size_and_crop_for_sdxl(tmp_path, tiny_model, concept):
    from types import SimpleNamespace

    from modules.model.sdxl import SDXLFamily

    wide = concept / "wide.png"
    Image.new("RGB", (128, 64), (200, 30, 30)).save(wide)
    dataset, _ = _dataset(tmp_path, tiny_model, {"path": concept}, data={"aspect_buckets": False})
    index = next(i for i, e in enumerate(dataset.entries) if e.item.image == wide)
    batch = dataset.collate([index], torch.device("cpu"))
    assert batch.image_info.tolist() == [[64.0, 128.0, 0.0, 32.0]]  # centred crop of a 2:1 image
    # the tiny VAE halves the image: its latents are 32x32 for the 64x64 bucket
    time_ids = SDXLFamily.time_ids(SimpleNamespace(vae_scale_factor=2), batch.latents, batch.image_info)
    assert time_ids.tolist() == [[64.0, 128.0, 0.0, 32.0, 64.0, 64.0]]
