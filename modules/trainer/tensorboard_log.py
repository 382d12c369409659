"""TensorBoard logs in workspace/tensorboard/: scalars (loss, lr, validation loss), sample images,
and sample videos as animated GIF image summaries (what TensorBoard's image tab plays).

torch's `add_video` would do the last, but it encodes the GIF with moviepy, which is not shipped:
here Pillow encodes it and the image summary carries the GIF bytes, as `add_video` writes them.

The writer is created on first use: importing tensorboard costs time and memory that the
run should not pay before its first step.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image


def gif_bytes(frames: list[Image.Image], fps: float) -> bytes:
    """The frames as a looping GIF, each quantized to its own 256-colour palette by fast octree
    (Pillow's default median cut takes ~0.5 s a frame at 832x480: 40 s for an 81-frame sample; this,
    ~1 s). Pillow merges a frame identical to the one before into that one's duration."""
    paletted = [frame.convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE) for frame in frames]
    buffer = io.BytesIO()
    paletted[0].save(buffer, format="GIF", save_all=True, append_images=paletted[1:], duration=round(1000 / fps),
                     loop=0)
    return buffer.getvalue()


class TensorBoardLog:
    def __init__(self, folder: Path, enabled: bool):
        self.folder = Path(folder)
        self.enabled = enabled
        self._writer = None

    def _open(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.folder))
        return self._writer

    def add(self, step: int, **scalars: float) -> None:
        if not self.enabled:
            return
        writer = self._open()
        for name, value in scalars.items():
            writer.add_scalar(name, value, step)

    def add_sample(self, step: int, tag: str, made: Image.Image | list[Image.Image], fps: float) -> None:
        """A sample: an image, or a video's frames (shown as an animated GIF)."""
        if not self.enabled:
            return
        writer = self._open()
        if isinstance(made, Image.Image):
            writer.add_image(tag, np.asarray(made.convert("RGB")), step, dataformats="HWC")
            return
        from tensorboard.compat.proto.summary_pb2 import Summary

        frames = [frame.convert("RGB") for frame in made]
        image = Summary.Image(height=frames[0].height, width=frames[0].width, colorspace=3,
                              encoded_image_string=gif_bytes(frames, fps))
        writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
