"""Video concepts on the tiny Wan model, with clips written by PyAV's encoder (mp4, webm, mkv),
animated GIF/WebP and frame folders: windows of 1 + 4n frames (shorter clips take the most they
hold; a 1-frame clip and a still image train as one frame), frame stride and fps resampling,
start/uniform/several windows, batches of one bucket and frame count, a broken clip named and
skipped, the latents cached once per window and reused after a restart, and a LoRA trained on clips."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import train_config
from PIL import Image

from modules.config.video_config import VideoConfig
from modules.data.video import ClipInfo, clip_windows, load_window, probe


def _frame(i: int, width: int, height: int) -> np.ndarray:
    """A frame whose content moves with i (a bright square sliding right over a gradient)."""
    y, x = np.mgrid[0:height, 0:width]
    frame = np.stack([(x * 255 // width), (y * 255 // height), np.full_like(x, 60)], axis=-1).astype(np.uint8)
    left = (i * 4) % max(1, width - 8)
    frame[height // 4:height // 4 + 8, left:left + 8] = 255
    return frame


def write_clip(path: Path, frames: int, fps: float = 8, width: int = 32, height: int = 32,
               codec: str = "mpeg4") -> Path:
    from fractions import Fraction

    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(_frame(i, width, height), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """A video concept folder: clips of odd lengths and rates, animated GIF and WebP, a frame
    folder, a 1-frame clip, a still image and a broken file; captions beside them."""
    folder = tmp_path_factory.mktemp("clips")
    write_clip(folder / "walk.mp4", 13, fps=8)
    write_clip(folder / "odd.webm", 7, fps=12.5, codec="libvpx")
    write_clip(folder / "one.mkv", 1, fps=24)
    images = [Image.fromarray(_frame(i, 32, 32)) for i in range(6)]
    images[0].save(folder / "spin.gif", save_all=True, append_images=images[1:], duration=100, loop=0)
    images[0].save(folder / "wave.webp", save_all=True, append_images=images[1:], duration=100, loop=0)
    (folder / "frames").mkdir()
    for i in range(9):
        Image.fromarray(_frame(i, 32, 32)).save(folder / "frames" / f"{i:04d}.png")
    Image.fromarray(_frame(3, 32, 32)).save(folder / "still.png")
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 this is no video at all" * 4)
    for name in ("walk", "odd", "one", "spin", "wave", "frames", "still", "broken"):
        (folder / f"{name}.txt").write_text(f"a square moving, {name}")
    return folder


def test_probe_reads_size_frames_and_rate_of_each_kind(clips):
    assert probe(clips / "walk.mp4") == ClipInfo((32, 32), 13, 8.0)
    odd = probe(clips / "odd.webm")
    assert odd.frames == 7 and odd.size == (32, 32) and math.isclose(odd.fps, 12.5)
    assert probe(clips / "one.mkv").frames == 1
    assert probe(clips / "spin.gif") == ClipInfo((32, 32), 6, 10.0)
    assert probe(clips / "wave.webp") == ClipInfo((32, 32), 6, 10.0)
    assert probe(clips / "frames") == ClipInfo((32, 32), 9, None)
    assert probe(clips / "still.png") is None
    with pytest.raises(Exception):  # noqa: B017 (PyAV's own error type)
        probe(clips / "broken.mp4")


def _indices(info, **options):
    return [w.indices for w in clip_windows(Path("c"), info, VideoConfig(**options), 4)]


def test_windows_follow_stride_fps_and_the_cut():
    info = ClipInfo((32, 32), 30, 24.0)
    assert _indices(info, frames=5) == [(0, 1, 2, 3, 4)]
    assert _indices(info, frames=5, frame_stride=3) == [(0, 3, 6, 9, 12)]
    assert _indices(info, frames=5, fps=12) == [(0, 2, 4, 6, 8)]  # 24 fps taken at 12: every other frame
    assert _indices(info, frames=9, clip_windows="several", windows=5) == [tuple(range(s, s + 9)) for s in (0, 9, 18)]
    uniform = _indices(info, frames=9, clip_windows="uniform", windows=3)
    assert [w[0] for w in uniform] == [0, 10, 21] and all(len(w) == 9 for w in uniform)  # first to last start
    # shorter than asked: the most 1 + 4n frames it holds; 1 frame: one frame
    assert _indices(ClipInfo((32, 32), 7, 8.0), frames=17) == [(0, 1, 2, 3, 4)]
    assert _indices(ClipInfo((32, 32), 1, 8.0), frames=17) == [(0,)]
    assert _indices(ClipInfo((32, 32), 9, None), frames=5, fps=12) == [(0, 1, 2, 3, 4)]  # a frame folder: no rate


def test_a_window_decodes_to_frames_like_images(clips):
    (window,) = clip_windows(clips / "walk.mp4", probe(clips / "walk.mp4"), VideoConfig(frames=5, frame_stride=2), 4)
    pixels = load_window(window, 32, 32)
    assert pixels.shape == (3, 5, 32, 32) and -1 <= pixels.min() < pixels.max() <= 1
    assert (pixels[:, 0] - pixels[:, 4]).abs().mean() > 0.01  # the frames differ: the square moved
    folder = load_window(clip_windows(clips / "frames", probe(clips / "frames"), VideoConfig(frames=5), 4)[0], 32, 32)
    gif = load_window(clip_windows(clips / "spin.gif", probe(clips / "spin.gif"), VideoConfig(frames=5), 4)[0], 32, 32)
    assert (folder - gif).abs().mean() < 0.05  # the same frames, losslessly stored
    one = load_window(clip_windows(clips / "one.mkv", probe(clips / "one.mkv"), VideoConfig(frames=5), 4)[0], 32, 32)
    assert one.shape == (3, 32, 32)  # one frame: an image


class Warnings:
    def __init__(self):
        self.messages = []

    def __call__(self, message):
        self.messages.append(message)


def _dataset(tiny_wan, folder, tmp_path, video, cache_dir=None, warn=None):
    from modules.data.dataset import prepare_dataset
    from modules.model.wan import WanFamily

    config = train_config(tiny_wan, folder, tmp_path, {"model": {"family": "wan"}, "data": {"resolution": 32},
                                                      "concepts": [{"path": str(folder), "video": video}]})
    family = WanFamily(config)
    family.load()
    dataset = prepare_dataset(config, family, torch.device("cpu"), cache_dir or tmp_path / "cache", warn or Warnings(),
                              cache_text=True)
    return dataset, family


@pytest.fixture(scope="session")
def tiny_wan(tiny_family_model):
    return tiny_family_model("wan")


def test_a_video_concept_buckets_by_frames_names_the_broken_clip_and_reuses_its_cache(clips, tiny_wan, tmp_path):
    warn = Warnings()
    dataset, family = _dataset(tiny_wan, clips, tmp_path, {"frames": 5}, warn=warn)
    by_name = {e.item.image.name: e for e in dataset.entries}
    assert sorted(by_name) == ["frames", "odd.webm", "one.mkv", "spin.gif", "still.png", "walk.mp4", "wave.webp"]
    assert [m for m in warn.messages if "broken.mp4" in m] == [
        next(m for m in warn.messages if m.startswith(f"skipping unreadable clip {clips / 'broken.mp4'}: "))]
    assert by_name["still.png"].clip is None and by_name["one.mkv"].clip.frames == 1
    assert by_name["walk.mp4"].clip.frames == 5 and by_name["odd.webm"].clip.frames == 5
    assert by_name["walk.mp4"].item.caption == "a square moving, walk"
    assert by_name["frames"].item.caption == "a square moving, frames"
    shapes = {name: tuple(dataset.latents[e.latent_key].shape) for name, e in by_name.items()}
    assert shapes["walk.mp4"] == shapes["frames"] == (16, 2, 8, 8)  # 5 frames -> 2 latent frames, 32 px / 4
    assert shapes["still.png"] == shapes["one.mkv"] == (16, 8, 8)
    for batch in dataset.epoch_batches(0):  # batch 2: never a clip beside a still
        assert len({dataset.entries[i].group for i in batch}) == 1
        dataset.collate(batch, torch.device("cpu"))
    assert dataset.cache_stats["latents"][1] == 7  # each window encoded once

    again, _ = _dataset(tiny_wan, clips, tmp_path, {"frames": 5})  # a restart: everything from the cache
    assert again.cache_stats["latents"] == (7, 0)
    assert all(torch.equal(again.latents[e.latent_key], dataset.latents[e.latent_key]) for e in again.entries)
    several, _ = _dataset(tiny_wan, clips, tmp_path, {"frames": 5, "clip_windows": "several"})
    walk = [e for e in several.entries if e.item.image.name == "walk.mp4"]
    assert [e.clip.indices[0] for e in walk] == [0, 5]  # 13 frames: two windows of 5
    assert several.cache_stats["latents"] == (7, 1)  # only walk's second window is new (the others hold one)


def test_a_family_without_video_and_a_frame_count_it_cannot_take_are_refused(clips, tiny_wan, tmp_path, tiny_model):
    from modules.data.concepts import DataError

    with pytest.raises(DataError, match=r"concepts\[0\]\.video\.frames: 6 is not 1 \+ 4 x n.*e\.g\. 5 or 9"):
        _dataset(tiny_wan, clips, tmp_path, {"frames": 6})
    from modules.data.dataset import prepare_dataset
    from modules.model.sd15 import SD15Family

    config = train_config(tiny_model, clips, tmp_path, {"concepts": [{"path": str(clips), "video": {"frames": 5}}]})
    with pytest.raises(DataError, match=r"concepts\[0\]\.video\.frames: 5, but Stable Diffusion 1\.5 trains and samples still images only"):
        family = SD15Family(config)
        family.load()
        prepare_dataset(config, family, torch.device("cpu"), tmp_path / "c", Warnings(), cache_text=True)


def test_a_lora_trains_on_clips_and_the_loss_falls(clips, tiny_wan, tmp_path):
    from conftest import fixed_loss

    from modules.trainer.generic_trainer import GenericTrainer

    folder = tmp_path / "walk"
    folder.mkdir()
    write_clip(folder / "walk.mp4", 9, fps=8)
    (folder / "walk.txt").write_text("a square moving right")
    config = train_config(tiny_wan, folder, tmp_path, {
        "model": {"family": "wan"}, "data": {"resolution": 32}, "concepts": [{"path": str(folder), "video": {"frames": 9}}],
        "adapter": {"layer_preset": "attn-mlp"}, "schedule": {"epochs": 40, "batch_size": 1}, "optimizer": {"lr": 1e-2},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    assert trainer.dataset.collate([0], trainer.device).latents.shape == (1, 16, 3, 8, 8)  # 9 frames: 3 latent
    before = fixed_loss(trainer, draws=8)
    trainer.train()
    after = fixed_loss(trainer, draws=8)
    assert after < before * 0.8, (before, after)


def test_clips_encode_per_batch_when_latents_are_not_cached(clips, tiny_wan, tmp_path):
    """data.cache_latents off (pixel augmentations): a clip's window is decoded, cropped and encoded per batch."""
    from modules.data.dataset import prepare_dataset
    from modules.model.wan import WanFamily

    config = train_config(tiny_wan, clips, tmp_path, {
        "model": {"family": "wan"}, "data": {"resolution": 32, "cache_latents": False, "crop_jitter": True},
        "concepts": [{"path": str(clips), "video": {"frames": 5}}]})
    family = WanFamily(config)
    family.load()
    dataset = prepare_dataset(config, family, torch.device("cpu"), tmp_path / "cache", Warnings(), cache_text=True)
    index = next(i for i, e in enumerate(dataset.entries) if e.item.image.name == "walk.mp4")
    assert dataset.collate([index], torch.device("cpu")).latents.shape == (1, 16, 2, 8, 8)
