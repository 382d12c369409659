"""The preflight's estimate for video concepts, before anything is cached: how many clips and
windows the concepts give, how long decoding them takes (timed on the first one or two windows
that are not cached yet, per frame decoded: a clip file is decoded from its start to a window's
last frame), and how much the latent cache will add on disk (each window's latent
grid from the VAE's compression, as cache_layout.py lays an entry out). preflight.py adds the cache
to what the disk of the cache folder must hold, and says the estimate before the model loads.

The windows, buckets and cache keys are the dataset's own (modules/data/dataset.py clip_entries),
so entries already in the cache (a restarted run) are neither timed nor counted as new. Where the
cache folder holds nothing yet, the clips are not hashed for keys (a first run reads them once).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from modules.config.train_config import TrainConfig
from modules.trainer.backup_size import describe

BLOCK = 4096  # a file takes whole blocks of the file system (ext4's and NTFS's default size)
HEADER = 512  # an entry's safetensors header (its tensor names, dtypes, shapes), about
TIMED_WINDOWS = 2


@dataclass(frozen=True)
class VideoEstimate:
    clips: int
    windows: int  # cache entries of clips: one per window and resolution
    unreadable: int  # clips the run will name and skip
    cached: int  # windows whose entry is in the cache already
    frames: int  # frames decoded for the windows not cached yet (read_frames' count, _frames_read)
    decode_seconds: float | None  # None: nothing to decode
    cache_bytes: int | None  # what the new entries take on disk; None: the family's latent grid is not known unloaded
    cache_dir: Path
    cache_field: str  # the config field that chooses the cache folder

    def summary(self) -> str:
        made = f"{self.clips} clip(s), {self.windows} window(s)"
        if self.unreadable:
            made += f", {self.unreadable} unreadable clip(s) skipped"
        if self.cached:
            made += f", {self.cached} already cached"
        decode = (f"decoding {self.frames} frames takes ~{_seconds(self.decode_seconds)} (timed on the first "
                  f"{min(TIMED_WINDOWS, self.windows - self.cached)} window(s))" if self.decode_seconds is not None
                  else "nothing to decode")
        size = (f"the latent cache grows by ~{describe(self.cache_bytes)}" if self.cache_bytes is not None
                else "the latent cache size is not known before the VAE loads")
        return f"video concepts: {made}; {decode}; {size} in {self.cache_dir}"


def _seconds(value: float) -> str:
    if value < 0.1:
        return f"{value * 1000:.0f} ms"
    return f"{value:.1f} s" if value < 120 else f"{value / 60:.0f} min"


def cache_space_problem(estimate: VideoEstimate) -> str | None:
    """The cache folder's disk cannot hold the new entries (`launch.py cache`, which writes only
    those; a training run's preflight adds them to its backups and saves on the same disk)."""
    import shutil

    from modules.trainer.preflight import nearest_existing

    existing = nearest_existing(estimate.cache_dir)
    free = shutil.disk_usage(existing).free
    if not estimate.cache_bytes or estimate.cache_bytes <= free:
        return None
    return (f"{estimate.cache_field}: not enough free disk space in {existing} for the latent cache of "
            f"{estimate.windows - estimate.cached} new video window(s): {describe(free)} free, they take about "
            f"{describe(estimate.cache_bytes)}; free some space, cut the video windows (concepts[i].video.windows or "
            ".frames, data.resolution), or set cache_dir to a folder on another disk")


def cache_folder(config: TrainConfig) -> tuple[Path, str]:
    """The run's cache folder (as the trainer chooses it) and the field that names it."""
    if config.cache_dir:
        return Path(config.cache_dir), "cache_dir"
    return Path(config.workspace_dir) / "cache", "workspace_dir"


def _frames_read(window) -> int:
    """Frames read_frames decodes for a window: a video file or an animated image from its start to
    the window's last frame (decoders go forward), a frame folder only the window's own files."""
    return len(set(window.indices)) if window.source.is_dir() else max(window.indices) + 1


def entry_bytes(entry, grid, family=None) -> int:
    """What one latent cache entry takes on disk (`grid`: cache_layout.LatentGrid), with the family's
    pixel conditioning (for the sample and, where it is mirrored, its mirrored version)."""
    from modules.data.cache_layout import expected_latent_layout

    layout = expected_latent_layout(entry, grid)
    elements = sum(math.prod(shape) for _, shape in layout.values())
    if family is not None:
        extra = family.pixel_conditioning_shapes(layout["latents"][1]).values()
        elements += sum(math.prod(shape) for shape in extra) * (2 if entry.flip else 1)
    return -(-(elements * 4 + HEADER) // BLOCK) * BLOCK  # float32 tensors and the header, in whole blocks


def estimate_video_cache(config: TrainConfig, family) -> VideoEstimate | None:
    """The estimate for the enabled video concepts; None when there is none (or the family takes no
    video)."""
    from modules.data.cache import TensorCache
    from modules.data.cache_layout import LatentGrid
    from modules.data.concepts import DataError, scan_concept
    from modules.data.dataset import clip_entries
    from modules.data.video import is_video_concept, load_window, scan_options

    concepts = [(i, c) for i, c in enumerate(config.concepts) if c.enabled and is_video_concept(c)]
    if not concepts or family.temporal_quantum is None:
        return None
    folder, field = cache_folder(config)
    cache = TensorCache(folder / "latents")
    identity = None  # no cache yet: no entry can be there, and no clip is hashed to look for one
    if cache.folder.is_dir():
        try:
            identity = family.fingerprint(*family.image_parts)
        except (ValueError, OSError):  # a weight mode still "auto", a part not there: none counts as cached
            identity = None
    geometry = family.latent_geometry()
    grid = LatentGrid(*geometry) if geometry else None
    clips = unreadable = windows = cached = frames = new_bytes = 0
    to_time = []
    for index, concept in concepts:
        try:
            items = scan_concept(index, concept, _ignore, **scan_options(concept))
        except DataError:
            continue  # the concept scan names it
        for item in items:
            entries = clip_entries(item, concept, config, family, identity, None, _ignore)
            if entries is None:
                continue  # a still image
            clips += 1
            unreadable += not entries
            for entry in entries:
                windows += 1
                if identity is not None and cache.path(entry.latent_key).is_file():
                    cached += 1
                    continue
                frames += _frames_read(entry.clip)
                new_bytes += entry_bytes(entry, grid, family) if grid else 0
                if len(to_time) < TIMED_WINDOWS:
                    to_time.append(entry)
    decode = None
    if to_time:
        started, timed = time.perf_counter(), 0
        for entry in to_time:
            try:
                load_window(entry.clip, *entry.bucket)
                timed += _frames_read(entry.clip)
            except Exception:  # damaged after its first frames: the run names and skips it
                continue
        decode = (time.perf_counter() - started) / timed * frames if timed else None
    return VideoEstimate(clips, windows, unreadable, cached, frames, decode, new_bytes if grid else None, folder, field)


def _ignore(_message: str) -> None:
    """The scan's and the probe's warnings are given again when the run builds its data."""
