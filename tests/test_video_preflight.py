"""The preflight's video estimate on tiny clips: clips and windows counted as the dataset cuts
them (a broken clip named as skipped), the decode time from timing the first windows, the latent
cache size equal to what caching then writes, nothing new after a restart, and a run refused when
the cache folder's disk cannot hold the new entries; on each Wan 2.2 family the estimate is what
caching writes."""

from __future__ import annotations

import re
import shutil
from collections import namedtuple

import pytest
from conftest import train_config
from PIL import Image
from test_video_data import _frame, write_clip


def _folder(tmp_path):
    """walk.mp4's windows decode 5 and 10 frames (from its start), the frame folder's 5 files."""
    folder = tmp_path / "clips"
    folder.mkdir()
    write_clip(folder / "walk.mp4", 13, fps=8)  # two windows of 5 (clip_windows several)
    (folder / "frames").mkdir()
    for i in range(9):  # one window of 5
        Image.fromarray(_frame(i, 32, 32)).save(folder / "frames" / f"{i:04d}.png")
    Image.fromarray(_frame(3, 32, 32)).save(folder / "still.png")
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 this is no video at all" * 4)
    for name in ("walk", "frames", "still", "broken"):
        (folder / f"{name}.txt").write_text(f"a square moving, {name}")
    return folder


def test_the_estimate_counts_times_and_sizes_the_video_cache_and_refuses_a_full_disk(tmp_path, tiny_family_model,
                                                                                      monkeypatch):
    from safetensors import safe_open

    from modules.cli.cache_command import build_caches
    from modules.errors import UserError
    from modules.model.wan import WanFamily
    from modules.trainer import preflight
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.video_preflight import BLOCK, estimate_video_cache

    config = train_config(tiny_family_model("wan"), _folder(tmp_path), tmp_path, {
        "model": {"family": "wan"}, "data": {"resolution": 32},
        "concepts": [{"path": str(tmp_path / "clips"), "video": {"frames": 5, "clip_windows": "several"}}]})
    cache_dir = tmp_path / "ws" / "cache"
    notes = []
    assert preflight.preflight_problems(config, notes) == []
    (note,) = notes
    assert re.match(r"video concepts: 3 clip\(s\), 3 window\(s\), 1 unreadable clip\(s\) skipped; decoding 20 frames "
                    r"takes ~\d+(\.\d)? m?s \(timed on the first 2 window\(s\)\); the latent cache grows by ~[\d.]+ KiB "
                    r"in " + re.escape(str(cache_dir)) + "$", note), note
    estimate = estimate_video_cache(config, WanFamily(config))
    assert estimate.decode_seconds > 0

    full = namedtuple("usage", "total used free")(1 << 40, 1 << 40, estimate.cache_bytes - 1)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: full)
    (problem,) = preflight.preflight_problems(config)
    assert problem.startswith("workspace_dir and output.path: not enough free disk space in ")
    assert "the latent cache of 3 new video window(s)" in problem and "concepts[i].video.windows" in problem
    with pytest.raises(UserError, match=r"^workspace_dir: not enough free disk space in .* for the latent cache of 3 "
                                        r"new video window\(s\)"):
        build_caches(config)  # `launch.py cache`: refused before the model loads
    monkeypatch.undo()

    said = []
    callbacks = TrainCallbacks()
    callbacks.on_status = said.append
    build_caches(config, callbacks)
    assert said[:2] == [note.replace(re.search(r"~\S+ m?s", note)[0], re.search(r"~\S+ m?s", said[0])[0]),
                        "loading model"]
    written = []
    for entry in (cache_dir / "latents").rglob("*.safetensors"):
        with safe_open(str(entry), "pt") as file:
            if len(file.get_slice("latents").get_shape()) == 4:  # a window's (C, F, h, w), not the still's
                written.append(entry.stat().st_size)
    assert len(written) == 3 and estimate.cache_bytes == sum(-(-size // BLOCK) * BLOCK for size in written)

    again = estimate_video_cache(config, WanFamily(config))  # a restart: every window is cached
    assert (again.cached, again.frames, again.decode_seconds, again.cache_bytes) == (3, 0, None, 0)


@pytest.mark.parametrize("family_name, overlay", [("wan22", {}), ("wan22_i2v", {}),
                                                  ("wan22_ti2v", {"image_to_video": 0.5})])
def test_the_cache_estimate_is_what_caching_writes_for_each_wan_22_family(tmp_path, tiny_family_model, family_name,
                                                                          overlay):
    """Two experts (one cache for both), the I2V condition beside the latents, the TI2V 5B's own
    VAE (48 channels, 16x smaller frames): the estimate is the bytes the cache then holds."""
    import torch

    from modules.config.families import get_family_class
    from modules.data.dataset import prepare_dataset
    from modules.trainer.video_preflight import BLOCK, cache_folder, estimate_video_cache

    clips = tmp_path / "clips"
    clips.mkdir()
    write_clip(clips / "walk.mp4", 13, fps=8)  # two windows of 5
    (clips / "walk.txt").write_text("a square moving")
    config = train_config(tiny_family_model(family_name), clips, tmp_path, {
        "model": {"family": family_name, **overlay}, "data": {"resolution": 32},
        "concepts": [{"path": str(clips), "video": {"frames": 5, "clip_windows": "several"}}]})
    family = get_family_class(family_name)(config)
    estimate = estimate_video_cache(config, family)
    family.load()
    folder = cache_folder(config)[0]
    prepare_dataset(config, family, torch.device("cpu"), folder, lambda _: None, cache_text=True)
    written = [-(-entry.stat().st_size // BLOCK) * BLOCK for entry in (folder / "latents").rglob("*.safetensors")]
    assert len(written) == 2 and estimate.cache_bytes == sum(written)
