"""Each Wan variant's video data on its own tiny model (Wan 2.1 T2V's is tests/test_video_data.py):
a clip's windows and a still image in one video concept are encoded once, with what the family
draws from each sample's pixels (the I2V first-frame condition and CLIP embeddings) cached beside
the latents of its own VAE (TI2V 5B: 48 channels, 16x); a restart reads every entry back from the
cache with equal tensors; a batch never mixes a clip with a still (frame buckets)."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config
from PIL import Image
from test_video_data import _frame, write_clip

from modules.config.families import get_family_class
from modules.data.dataset import prepare_dataset

VARIANTS = ("wan_i2v", "wan22", "wan22_i2v", "wan22_ti2v")


@pytest.fixture(scope="module")
def concept(tmp_path_factory):
    """A 13-frame clip (two windows of 5, clip_windows "several") and a still image, captioned."""
    folder = tmp_path_factory.mktemp("wan-variant-clips")
    write_clip(folder / "walk.mp4", 13, fps=8)
    Image.fromarray(_frame(3, 32, 32)).save(folder / "still.png")
    for name in ("walk", "still"):
        (folder / f"{name}.txt").write_text(f"a square moving, {name}")
    return folder


def _prepared(config, cache):
    """The data set a fresh process builds: a newly loaded family, the cache folder as left."""
    family = get_family_class(config.model.family)(config)
    family.load()
    return prepare_dataset(config, family, torch.device("cpu"), cache, lambda _: None, cache_text=True)


@pytest.mark.parametrize("family_name", VARIANTS)
def test_a_restart_reads_each_window_and_its_condition_back_from_the_cache(family_name, concept, tiny_family_model,
                                                                           tmp_path):
    config = train_config(tiny_family_model(family_name), concept, tmp_path, {
        "model": {"family": family_name}, "data": {"resolution": 32},
        "concepts": [{"path": str(concept), "video": {"frames": 5, "clip_windows": "several"}}]})
    first = _prepared(config, tmp_path / "cache")
    assert first.cache_stats["latents"] == (0, 3)  # two windows and the still, each encoded once
    assert sorted(e.clip.frames if e.clip else 1 for e in first.entries) == [1, 5, 5]
    again = _prepared(config, tmp_path / "cache")
    assert again.cache_stats["latents"] == (3, 0)
    for index in range(len(first.entries)):
        ours, theirs = (d.collate([index], torch.device("cpu")) for d in (again, first))
        assert torch.equal(ours.latents, theirs.latents)
        assert (ours.pixel_conditioning or {}).keys() == (theirs.pixel_conditioning or {}).keys()
        assert all(torch.equal(v, theirs.pixel_conditioning[k]) for k, v in (ours.pixel_conditioning or {}).items())
    if family_name in ("wan_i2v", "wan22_i2v"):  # the first frame's condition is cached with the window's latents
        window = next(i for i, e in enumerate(again.entries) if e.clip)
        assert "image_condition" in again.collate([window], torch.device("cpu")).pixel_conditioning
    batches = again.epoch_batches(0)  # batch 2: the two windows together, the still alone
    assert sorted(len(b) for b in batches) == [1, 2]
    assert all(len({again.latents[again.entries[i].latent_key].shape for i in batch}) == 1 for batch in batches)
