"""The latent and text caches are reused when nothing changed and rebuilt when the image, the
caption, the resolution or the model changed."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import train_config

from modules.data.dataset import prepare_dataset
from modules.model.sd15 import SD15Family


def prepare(config, family, cache_dir):
    return prepare_dataset(config, family, torch.device("cpu"), cache_dir, lambda message: None, cache_text=True)


@pytest.fixture()
def setup(tmp_path, tiny_model, shape_images):
    images = tmp_path / "images"
    shutil.copytree(shape_images, images)
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = train_config(model, images, tmp_path)
    family = SD15Family(config)
    family.load()
    cache_dir = tmp_path / "cache"
    prepare(config, family, cache_dir)
    return config, family, cache_dir, images, model


def counted(config, family, cache_dir):
    """((latent hits, misses), (text hits, misses)) of preparing the dataset again."""
    stats = prepare(config, family, cache_dir).cache_stats
    return stats["latents"], stats["text"]


def test_unchanged_inputs_hit_the_cache(setup):
    config, family, cache_dir, _, _ = setup
    assert counted(config, family, cache_dir) == ((4, 0), (4, 0))


def test_a_changed_caption_re_encodes_only_that_text(setup):
    config, family, cache_dir, images, _ = setup
    caption = sorted(images.glob("*.txt"))[0]
    caption.write_text("a completely different caption")
    assert counted(config, family, cache_dir) == ((4, 0), (3, 1))


def test_a_changed_image_re_encodes_only_that_latent(setup):
    from PIL import Image

    config, family, cache_dir, images, _ = setup
    image = sorted(images.glob("*.png"))[1]
    Image.new("RGB", (64, 64), (1, 2, 3)).save(image)
    assert counted(config, family, cache_dir) == ((3, 1), (4, 0))


def test_a_changed_resolution_re_encodes_every_latent(setup):
    config, family, cache_dir, _, _ = setup
    bigger = config.model_copy(update={"data": config.data.model_copy(update={"resolution": 128})})
    assert counted(bigger, family, cache_dir) == ((0, 4), (4, 0))


def test_changed_model_weights_re_encode(setup):
    config, family, cache_dir, _, model = setup
    weights = model / "vae" / "diffusion_pytorch_model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # as a re-downloaded file would
    assert counted(config, family, cache_dir) == ((0, 4), (4, 0))
    text_weights = model / "text_encoder" / "model.safetensors"
    os.utime(text_weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
    assert counted(config, family, cache_dir) == ((4, 0), (0, 4))


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_an_entry_of_another_shape_or_dtype_is_encoded_again(setup, change):
    """A valid safetensors file whose names are right but whose tensor is not what the image and
    bucket give (its shape or dtype) is stale, not a batch's `stack expects each tensor to be equal size`."""
    from safetensors.torch import load_file, save_file

    config, family, cache_dir, _, _ = setup
    entries = sorted((cache_dir / "latents").rglob("*.safetensors"))
    good = load_file(entries[0])["latents"]
    stored = good[:, ::2, ::2] if change == "shape" else good.half()
    save_file({"latents": stored.contiguous()}, str(entries[0]))
    warnings = []
    dataset = prepare_dataset(config, family, torch.device("cpu"), cache_dir, warnings.append, cache_text=True)
    assert dataset.cache_stats["latents"] == (3, 1)
    assert warnings == [f"1 latent cache entry in {cache_dir / 'latents'} held tensors of other shapes or dtypes "
                        "than their image, bucket and model give (damaged, or written by another program?); "
                        "encoding them again"]
    batch = dataset.collate(list(range(len(dataset.entries))), torch.device("cpu"))
    assert batch.latents.shape == (4, *good.shape)
    assert torch.allclose(load_file(entries[0])["latents"], good, atol=1e-5)  # (encoded alone, not in a batch of 4)


def test_a_text_entry_of_another_shape_is_encoded_again(setup):
    from safetensors.torch import load_file, save_file

    config, family, cache_dir, _, _ = setup
    entries = sorted((cache_dir / "text").rglob("*.safetensors"))
    good = load_file(entries[0])
    save_file({name: tensor[:-1].contiguous() for name, tensor in good.items()}, str(entries[0]))
    warnings = []
    dataset = prepare_dataset(config, family, torch.device("cpu"), cache_dir, warnings.append, cache_text=True)
    assert dataset.cache_stats["text"] == (3, 1)
    assert warnings == [f"1 text cache entry in {cache_dir / 'text'} held tensors of other shapes or dtypes than "
                        "the text encoders give (damaged, or written by another program?); encoding them again"]
    batch = dataset.collate(list(range(len(dataset.entries))), torch.device("cpu"))
    assert {name: tuple(t.shape[1:]) for name, t in batch.text.items()} == {n: tuple(t.shape) for n, t in good.items()}
