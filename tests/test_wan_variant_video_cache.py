"""Each Wan variant's video data on its own tiny model (Wan 2.1 T2V's is tests/test_video_data.py):
clips of odd lengths and rates, a 1-frame clip and a still image in one video concept are encoded
once (a broken file named and skipped), with what the family draws from each sample's pixels (the
I2V first-frame condition and CLIP embeddings) cached beside the latents of its own VAE (TI2V 5B:
48 channels, 16x); a restart reads every entry back from the cache with equal tensors; a batch
never mixes a clip with a still (frame buckets)."""

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
    """A 13-frame clip (two windows of 5, clip_windows "several"), a 7-frame one at 12.5 fps, a
    1-frame one, a still image and a broken file, captioned."""
    folder = tmp_path_factory.mktemp("wan-variant-clips")
    write_clip(folder / "walk.mp4", 13, fps=8)
    write_clip(folder / "odd.webm", 7, fps=12.5, codec="libvpx")
    write_clip(folder / "one.mkv", 1, fps=24)
    Image.fromarray(_frame(3, 32, 32)).save(folder / "still.png")
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 this is no video at all" * 4)
    for name in ("walk", "odd", "one", "still", "broken"):
        (folder / f"{name}.txt").write_text(f"a square moving, {name}")
    return folder


def _prepared(config, cache, warnings: list[str]):
    """The data set a fresh process builds: a newly loaded family, the cache folder as left."""
    family = get_family_class(config.model.family)(config)
    family.load()
    return prepare_dataset(config, family, torch.device("cpu"), cache, warnings.append, cache_text=True)


@pytest.mark.parametrize("family_name", VARIANTS)
def test_a_restart_reads_each_window_and_its_condition_back_from_the_cache(family_name, concept, tiny_family_model,
                                                                           tmp_path):
    config = train_config(tiny_family_model(family_name), concept, tmp_path, {
        "model": {"family": family_name}, "data": {"resolution": 32},
        "concepts": [{"path": str(concept), "video": {"frames": 5, "clip_windows": "several"}}]})
    warnings: list[str] = []
    first = _prepared(config, tmp_path / "cache", warnings)
    assert first.cache_stats["latents"] == (0, 5)  # walk's two windows, odd's one, one.mkv, the still: once each
    assert sorted((e.item.image.name, e.clip.frames if e.clip else 1) for e in first.entries) == [
        ("odd.webm", 5), ("one.mkv", 1), ("still.png", 1), ("walk.mp4", 5), ("walk.mp4", 5)]
    assert sum(w.startswith(f"skipping unreadable clip {concept / 'broken.mp4'}: ") for w in warnings) == 1
    again = _prepared(config, tmp_path / "cache", [])
    assert again.cache_stats["latents"] == (5, 0)
    for index in range(len(first.entries)):
        ours, theirs = (d.collate([index], torch.device("cpu")) for d in (again, first))
        assert torch.equal(ours.latents, theirs.latents)
        assert (ours.pixel_conditioning or {}).keys() == (theirs.pixel_conditioning or {}).keys()
        assert all(torch.equal(v, theirs.pixel_conditioning[k]) for k, v in (ours.pixel_conditioning or {}).items())
    if family_name in ("wan_i2v", "wan22_i2v"):  # the first frame's condition is cached with the window's latents
        window = next(i for i, e in enumerate(again.entries) if e.clip)
        assert "image_condition" in again.collate([window], torch.device("cpu")).pixel_conditioning
    batches = again.epoch_batches(0)  # batch 2, each of one frame count: three 5-frame windows, two stills
    assert sorted(len(b) for b in batches) == [1, 2, 2]
    assert all(len({again.latents[again.entries[i].latent_key].shape for i in batch}) == 1 for batch in batches)
