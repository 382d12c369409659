"""A concept's video options (torch-free): how many frames one sample holds and how clips are cut
into samples. modules/data/video.py reads clips by these; the model family decides which frame
counts it takes (Wan: 1 + 4n)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modules.config.strict import StrictModel

MAX_FRAMES = 1025  # 1 + 4 x 256: a minute at 17 fps
MAX_FRAME_STRIDE = 1000
MAX_FPS = 240.0
MAX_WINDOWS = 1000


class VideoConfig(StrictModel):
    frames: int = Field(1, ge=1, le=MAX_FRAMES, description="Frames per sample. 1: a still-image concept (video "
                        "files are not read). More: clips (.mp4 .webm .mov .mkv, animated .gif/.webp, and folders of "
                        "frame images) train as windows of this many frames (the family's count: Wan 1 + 4n); a clip "
                        "shorter than that trains with the most frames it holds; still images train as one frame.")
    frame_stride: int = Field(1, ge=1, le=MAX_FRAME_STRIDE, description="Take every n-th frame of a clip (when "
                              "fps is not set).")
    fps: float | None = Field(None, gt=0, le=MAX_FPS, description="Resample clips to this frame rate before "
                              "cutting windows (from each clip's own rate; frame folders have none and take every "
                              "frame). None: frame_stride.")
    clip_windows: Literal["start", "uniform", "several"] = Field(
        "start", description="start: one window from the first frame; uniform: `windows` windows spread evenly "
        "over the clip; several: back-to-back windows from the start, at most `windows`. Each window is one "
        "cache entry and one sample.")
    windows: int = Field(3, ge=1, le=MAX_WINDOWS, description="clip_windows uniform or several: how many windows "
                         "a clip gives at most.")
