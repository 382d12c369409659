"""Playing a sample video in the gallery: its frames decoded at thumbnail size (PyAV for .mp4,
Pillow for an animated .webp), cycled in the cell's label at the video's frame rate, and an
"Open" that hands the file to the system's player. Decoding happens when the user presses Play,
never while the gallery is drawn: the gallery shows the poster until then."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from PIL import Image, ImageSequence

# a sample is at most a few hundred frames; a bound keeps a foreign long file from filling memory
MAX_FRAMES = 600
DEFAULT_FPS = 16.0


def _thumbnail(image: Image.Image, size: int) -> Image.Image:
    image = image.convert("RGB")
    scale = size / max(image.size)
    return image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))))


def read_frames(video: Path, size: int) -> tuple[list[Image.Image], float]:
    """(frames scaled so their longer side is `size`, frames per second) of a sample video."""
    video = Path(video)
    if video.suffix.lower() == ".mp4":
        import av

        with av.open(str(video)) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate or DEFAULT_FPS)
            frames = []
            for frame in container.decode(stream):
                frames.append(_thumbnail(frame.to_image(), size))
                if len(frames) == MAX_FRAMES:
                    break
        return frames, fps
    with Image.open(video) as animation:
        frames, durations = [], []
        for frame in ImageSequence.Iterator(animation):
            frames.append(_thumbnail(frame, size))
            durations.append(frame.info.get("duration") or 0)
            if len(frames) == MAX_FRAMES:
                break
    milliseconds = sum(durations) / len(durations)
    return frames, (1000.0 / milliseconds if milliseconds > 0 else DEFAULT_FPS)


def open_with_system(path: Path) -> str | None:
    """Open `path` in the desktop's default application; None, or what went wrong."""
    try:
        if sys.platform == "win32":
            os.startfile(str(path))  # noqa: S606 (the user's own sample, opened at their click)
        else:
            command = "open" if sys.platform == "darwin" else "xdg-open"
            subprocess.Popen([command, str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    except OSError as error:
        return f"could not open {path.name}: {error.strerror or error}"
    return None


class FramePlayer:
    """Cycles `frames` (CTkImages) in `label` every 1/fps seconds until stopped or the label is gone."""

    def __init__(self, label, frames: list, fps: float):
        self.label, self.frames = label, frames
        self.interval = max(10, round(1000 / fps))
        self.index = 0
        self.job = None
        self.shown = 0  # frames shown so far (what a test reads to see it play)

    @property
    def playing(self) -> bool:
        return self.job is not None

    def start(self) -> None:
        if self.job is None:
            self._next()

    def stop(self) -> None:
        if self.job is not None:
            try:
                self.label.after_cancel(self.job)
            except Exception:  # the window is gone: nothing to cancel
                pass
            self.job = None

    def _next(self) -> None:
        if not self.label.winfo_exists():
            self.job = None
            return
        self.label.configure(image=self.frames[self.index])
        self.shown += 1
        self.index = (self.index + 1) % len(self.frames)
        self.job = self.label.after(self.interval, self._next)
