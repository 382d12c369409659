"""Clips for video concepts (`concepts[i].video.frames` > 1): what a clip is, its size, frame count
and rate read without decoding its pictures, the windows of frames cut from it, and a window's
frames as one (3, F, H, W) tensor resized and cropped like an image.

A clip is a video file (.mp4 .webm .mov .mkv, decoded with PyAV), an animated GIF or WebP (read
with Pillow), or a folder of frame images (sorted by name) in the concept's folder. A still image
in a video concept is a one-frame sample, and so is a window of one frame: (3, H, W), batched with
the stills. A clip that cannot be read raises here; the data pipeline names it and skips it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, ImageSequence

from modules.config.video_config import VideoConfig
from modules.data.concepts import IMAGE_SUFFIXES
from modules.data.images import cover_size, crop_box, to_mode

VIDEO_SUFFIXES = {".mp4", ".webm", ".mov", ".mkv"}
ANIMATED_SUFFIXES = {".gif", ".webp"}  # a one-frame one is a still image


def is_video_concept(concept) -> bool:
    return concept.video.frames > 1


def scan_options(concept) -> dict:
    """What scan_concept also takes as items in a video concept: clip files and frame folders."""
    return {"clip_suffixes": VIDEO_SUFFIXES | ANIMATED_SUFFIXES, "frame_folders": True} if is_video_concept(concept) else {}


def frame_count_problem(frames: int, temporal: int | None, label: str) -> str | None:
    """Why a family cannot take samples of `frames` frames (a concept's or a sample prompt's), or None."""
    if frames == 1:
        return None
    if temporal is None:
        return f"{frames}, but {label} trains and samples still images only (set it to 1)"
    if (frames - 1) % temporal:
        below = 1 + (frames - 1) // temporal * temporal
        return f"{frames} is not 1 + {temporal} x n, the frame counts {label} takes (e.g. {below} or {below + temporal})"
    return None


@dataclass(frozen=True)
class ClipInfo:
    size: tuple[int, int]  # (width, height)
    frames: int
    fps: float | None  # None: a frame folder (no rate of its own)


@dataclass(frozen=True)
class ClipWindow:
    """The frames of one sample: indices into the clip's decoded frames."""

    source: Path
    indices: tuple[int, ...]
    latent_frames: int  # what the family's VAE makes of them

    @property
    def frames(self) -> int:
        return len(self.indices)


def frame_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def probe(path: Path) -> ClipInfo | None:
    """The clip's size, frame count and rate; None for a still image (one frame of an image file)."""
    if path.is_dir():
        files = frame_files(path)
        if not files:
            raise ValueError("the folder holds no frame images")
        with Image.open(files[0]) as first:
            return ClipInfo(first.size, len(files), None)
    suffix = path.suffix.lower()
    if suffix in VIDEO_SUFFIXES:
        import av

        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError("it has no video stream")
            stream = container.streams.video[0]
            size = (stream.codec_context.width, stream.codec_context.height)
            count = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
            rate = float(stream.average_rate) if stream.average_rate else None
        if not count or not all(size):
            raise ValueError("it holds no decodable frame")
        return ClipInfo(size, count, rate)
    if suffix in ANIMATED_SUFFIXES:
        with Image.open(path) as image:
            count = getattr(image, "n_frames", 1)
            if count <= 1:
                return None
            durations = []
            for frame in ImageSequence.Iterator(image):
                frame.load()  # (WebP sets a frame's duration when it is read)
                durations.append(frame.info.get("duration") or 0)
            size = image.size
        mean = sum(durations) / len(durations)
        return ClipInfo(size, count, 1000.0 / mean if mean > 0 else None)
    return None


def window_length(available: int, wanted: int, temporal: int) -> int:
    """The frames a sample takes: `wanted`, or the most of the form 1 + temporal * n the clip holds."""
    if available >= wanted:
        return wanted
    return 1 + (available - 1) // temporal * temporal


def clip_windows(path: Path, info: ClipInfo, video: VideoConfig, temporal: int) -> list[ClipWindow]:
    """The windows a clip gives under the concept's video options (frame_stride or fps; start,
    uniform or several), each as the indices of its frames in the clip."""
    step = info.fps / video.fps if video.fps and info.fps else float(video.frame_stride)
    available = int((info.frames - 1) / step + 1e-9) + 1  # frames on the resampled timeline
    frames = window_length(available, video.frames, temporal)
    spare = available - frames
    if video.clip_windows == "start":
        starts = [0]
    elif video.clip_windows == "uniform":
        count = min(video.windows, spare + 1)
        starts = sorted({round(spare * i / (count - 1)) for i in range(count)}) if count > 1 else [0]
    else:  # several: back to back from the start
        starts = list(range(0, spare + 1, frames))[:video.windows]
    last, latent = info.frames - 1, latent_frames(frames, temporal)
    return [ClipWindow(path, tuple(min(last, round((start + k) * step)) for k in range(frames)), latent)
            for start in starts]


def content_hash(path: Path) -> str:
    """The clip's content: its file's bytes, or a frame folder's frames' bytes in order."""
    digest = hashlib.sha1()
    for file in frame_files(path) if path.is_dir() else [path]:
        digest.update(hashlib.sha1(file.read_bytes()).digest())
    return digest.hexdigest()


def read_frames(path: Path, indices: tuple[int, ...]) -> list[Image.Image]:
    """The clip's frames at `indices` (ascending, repeats allowed) as RGB images."""
    wanted = sorted(set(indices))
    found: dict[int, Image.Image] = {}
    if path.is_dir():
        files = frame_files(path)
        for index in wanted:
            with Image.open(files[index]) as image:
                found[index] = to_mode(ImageOps.exif_transpose(image), "RGB")  # (a copy: read before the close)
    elif path.suffix.lower() in VIDEO_SUFFIXES:
        import av

        with av.open(str(path)) as container:
            for number, frame in enumerate(container.decode(video=0)):
                if number in indices:
                    found[number] = frame.to_image().convert("RGB")
                if number >= wanted[-1]:
                    break
    else:
        with Image.open(path) as image:
            for number, frame in enumerate(ImageSequence.Iterator(image)):
                if number in indices:
                    found[number] = to_mode(frame.copy(), "RGB")
                if number >= wanted[-1]:
                    break
    missing = [i for i in wanted if i not in found]
    if missing:
        raise ValueError(f"frame {missing[0]} could not be decoded (the clip ends or is damaged there)")
    return [found[i] for i in indices]


def load_window(window: ClipWindow, width: int, height: int,
                position: tuple[float, float] = (0.5, 0.5)) -> torch.Tensor:
    """(3, F, height, width) in [-1, 1], every frame resized to cover and cropped at `position` as
    an image is; (3, height, width) for a one-frame window."""
    frames = []
    for image in read_frames(window.source, window.indices):
        image = image.resize(cover_size(image.size, width, height), Image.Resampling.LANCZOS)
        image = image.crop(crop_box(image.size, width, height, position))
        frames.append(torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1))
    return frames[0].contiguous() if len(frames) == 1 else torch.stack(frames, dim=1).contiguous()


def latent_frames(frames: int, temporal: int) -> int:
    """Latent frames of a window of `frames` (1 + 4n frames: 1 + n for Wan's VAE)."""
    return 1 + math.ceil((frames - 1) / temporal)


def load_entry_pixels(entry, width: int, height: int, position: tuple[float, float] = (0.5, 0.5)) -> torch.Tensor:
    """A data entry's pixels: its clip window's frames, or its image."""
    from modules.data.images import load_cropped

    if entry.clip is not None:
        return load_window(entry.clip, width, height, position)
    return load_cropped(entry.item.image, width, height, position)
