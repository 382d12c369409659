"""Samples reach TensorBoard: a still sample as an image, a video sample (tiny Wan, 5 frames) as
an animated GIF image summary that decodes to the sample's frame count (encoded with Pillow: torch's
add_video needs moviepy, which is not shipped)."""

from __future__ import annotations

import io

from conftest import train_config
from PIL import Image


def test_a_video_sample_is_a_gif_of_its_frames_in_the_event_file(tmp_path, tiny_family_model, one_image):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from modules.trainer.generic_trainer import GenericTrainer

    prompts = [{"prompt": "a red circle", "steps": 2, "cfg": 1.0, "width": 32, "height": 32, "seed": 3, "frames": 5},
               {"prompt": "a blue square", "steps": 2, "cfg": 1.0, "width": 32, "height": 32, "seed": 4}]
    config = train_config(tiny_family_model("wan"), one_image, tmp_path, {
        "model": {"family": "wan"}, "tensorboard": True, "sampling": {"prompts": prompts}})
    trainer = GenericTrainer(config)
    trainer.start()
    try:
        posters = trainer.sample()
    finally:
        trainer.tensorboard.close()  # flushes the event file
    assert [p.name for p in posters] == ["step0000000-0.png", "step0000000-1.png"]
    events = EventAccumulator(str(trainer.workspace / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    (video,) = events.Images("samples/0")
    with Image.open(io.BytesIO(video.encoded_image_string)) as gif:
        assert (gif.format, gif.n_frames, gif.size) == ("GIF", 5, (32, 32))
        assert (video.width, video.height) == (32, 32)
    (still,) = events.Images("samples/1")
    with Image.open(io.BytesIO(still.encoded_image_string)) as png:
        assert (png.format, png.size) == ("PNG", (32, 32))
