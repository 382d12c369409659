"""Sample videos on disk: H.264 .mp4 through PyAV (yuv420p, what browsers, players and TensorBoard
play), or an animated .webp through Pillow where PyAV or its H.264 encoder is missing; with the
first frame as a .png poster beside it (what the GUI's gallery shows). Written to a temp name and
renamed, as every file the trainer writes."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

from modules.util.atomic import write_with

# what write_sample_video writes beside a poster, in the order it prefers them
VIDEO_SUFFIXES = (".mp4", ".webp")


def mp4_encoder_available() -> bool:
    try:
        import av

        av.codec.Codec("libx264", "w")
        return True
    except Exception:  # no PyAV, or an FFmpeg build without libx264
        return False


def _write_mp4(temp: Path, frames: list[Image.Image], fps: float) -> None:
    import av

    with av.open(str(temp), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = frames[0].width, frames[0].height, "yuv420p"
        stream.options = {"crf": "18"}  # near-lossless: a sample shows what the model made
        for image in frames:
            frame = av.VideoFrame.from_ndarray(np.asarray(image.convert("RGB")), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_sample_video(stem: Path, frames: list[Image.Image], fps: float) -> tuple[Path, Path]:
    """(the video, its poster): `<stem>.mp4` (or `<stem>.webp`) and `<stem>.png`."""
    if mp4_encoder_available() and frames[0].width % 2 == 0 and frames[0].height % 2 == 0:
        video = stem.with_suffix(VIDEO_SUFFIXES[0])
        write_with(video, lambda temp: _write_mp4(temp, frames, fps))
    else:
        video = stem.with_suffix(VIDEO_SUFFIXES[1])
        write_with(video, lambda temp: frames[0].save(temp, format="WEBP", save_all=True, append_images=frames[1:],
                                                      duration=round(1000 / fps), loop=0, lossless=True))
    poster = stem.with_suffix(".png")
    write_with(poster, lambda temp: frames[0].save(temp, format="PNG"))
    return video, poster


def video_of_poster(poster: Path) -> Path | None:
    """The sample video a poster `<stem>.png` stands for (`<stem>.mp4` or `<stem>.webp`), or None
    for a still sample."""
    for suffix in VIDEO_SUFFIXES:
        video = Path(poster).with_suffix(suffix)
        if video.is_file():
            return video
    return None
