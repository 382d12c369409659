"""Qwen-VL captions (issue 30 item 2) with tiny random Qwen2-VL, Qwen2.5-VL and Qwen3-VL models built
offline from their transformers configs (modules/autolabel/tiny_models.py), on the path `launch.py caption`
and the dataset tool's Auto-caption take: the `chat` kind chosen from the folder, its loader,
caption_images (the command's own wiring, its events and stdin stop: tests/test_autolabel.py, with
BLIP). torchvision is not installed here, so the processor is the image-only one
(modules/autolabel/image_only_processor.py): without it, it would not load at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from modules.autolabel.caption_folder import caption_images
from modules.autolabel.captioners import kind_for
from modules.autolabel.images import read_caption
from modules.autolabel.model_folder import LabelModelError
from modules.data.synthetic_images import write_shape_images
from modules.trainer.commands import TrainCommands

CHAT_TOKENS = ("<|", "assistant", "user")


def torchvision_installed() -> bool:
    from transformers.utils import is_torchvision_available

    return is_torchvision_available()


@pytest.fixture(scope="module")
def qwen(tiny_labellers):
    folder = tiny_labellers("qwen2_vl")
    kind = kind_for(folder)
    return folder, kind, kind.load(folder, "cpu", "float32")


def images_in(folder: Path, names: list[str], captions: list[str] | None = None) -> list[Path]:
    """Images named after words the tiny tokenizer knows (so that `{name}` reads back), without captions
    unless given."""
    images = []
    for index, (path, name) in enumerate(zip(write_shape_images(folder, count=len(names), width=48, height=40), names)):
        path.with_suffix(".txt").unlink()
        images.append(path.rename(folder / f"{name}.png"))
        if captions is not None:
            images[-1].with_suffix(".txt").write_text(captions[index] + "\n", encoding="utf-8")
    return images


def test_qwen2_vl_captions_every_image_and_each_mode_keeps_or_replaces(qwen, tmp_path):
    _, kind, captioner = qwen
    assert kind.name == "chat"
    if not torchvision_installed():
        assert "video_processor" not in type(captioner.processor).get_attributes()
    images = images_in(tmp_path, ["red", "blue", "green", "yellow", "square"])
    images[0].with_suffix(".txt").write_text("my own caption\n", encoding="utf-8")
    progress = []
    report = caption_images(images, captioner, kind.default_prompt, "skip-existing", batch_size=2, max_new_tokens=5,
                            on_progress=lambda r, path: progress.append(r.done))
    assert report.skipped == images[:1] and read_caption(images[0]) == "my own caption"
    assert report.written == images[1:] and progress == [1, 2, 3, 4, 5]
    generated = {image: read_caption(image) for image in images[1:]}
    assert all(generated.values())
    assert not any(token in caption for caption in generated.values() for token in CHAT_TOKENS)  # the answer alone

    report = caption_images(images, captioner, kind.default_prompt, "append", batch_size=3, max_new_tokens=5)
    assert len(report.written) == 5 and read_caption(images[0]).startswith("my own caption, ")
    assert all(read_caption(image) == f"{caption}, {caption}" for image, caption in generated.items())

    report = caption_images(images, captioner, kind.default_prompt, "overwrite", batch_size=2, max_new_tokens=5)
    assert report.written == images and not read_caption(images[0]).startswith("my own caption")
    assert all(read_caption(image) == caption for image, caption in generated.items())  # replaced by the same answer


def test_the_prompt_template_reaches_the_model_and_a_batch_equals_each_image_alone(qwen, tmp_path, monkeypatch):
    from PIL import Image

    _, _, captioner = qwen
    images = images_in(tmp_path, ["red", "blue", "green"], captions=["a circle", "a blue square", "the triangle"])
    filled = ["describe this red image with a circle", "describe this blue image with a blue square",
              "describe this green image with the triangle"]
    seen = []
    generate = captioner.model.generate

    def spy(**inputs):
        seen.extend(captioner.processor.tokenizer.batch_decode(inputs["input_ids"]))
        return generate(**inputs)

    monkeypatch.setattr(captioner.model, "generate", spy)
    report = caption_images(images, captioner, "describe this {name} image with {caption}", "overwrite",
                            batch_size=3, max_new_tokens=5)
    assert report.written == images and len(seen) == 3
    for prompt, expected in zip(seen, filled):
        # the user's turn: the image's tokens (one per merged 2x2 of its 8 px patches), then the filled template
        assert f"<|vision_start|> {' '.join(['<|image_pad|>'] * 6)} <|vision_end|> {expected} <|im_end|>" in prompt
        assert prompt.endswith("<|im_start|> assistant")  # padded on the left: the answer follows the prompt
    batched = [read_caption(image) for image in images]
    alone = [captioner.caption([Image.open(image).convert("RGB")], [prompt], 5)[0]
             for image, prompt in zip(images, filled)]
    assert alone == batched


def test_a_stop_request_ends_the_run_between_images(qwen, tmp_path):
    _, kind, captioner = qwen
    images = images_in(tmp_path, ["red", "blue", "green", "yellow"])
    commands = TrainCommands()  # what `launch.py caption` stops: a stop command on stdin, or SIGINT/SIGTERM

    def on_progress(report, image):
        if len(report.written) == 1:
            commands.stop()

    report = caption_images(images, captioner, kind.default_prompt, "overwrite", batch_size=1, max_new_tokens=4,
                            on_progress=on_progress, stop_requested=lambda: commands.stop_requested)
    assert report.stopped and report.written == images[:1] and read_caption(images[0])
    assert [image.with_suffix(".txt").exists() for image in images] == [True, False, False, False]
    assert "stopped after 1 of 4 images" in report.summary()


@pytest.mark.parametrize("model, processor", [("qwen2_5_vl", "Qwen2_5_VLProcessor"), ("qwen3_vl", "Qwen3VLProcessor")])
def test_qwen2_5_vl_and_qwen3_vl_caption_every_image_through_the_same_kind(tiny_labellers, tmp_path, model, processor):
    folder = tiny_labellers(model)
    kind = kind_for(folder)
    captioner = kind.load(folder, "cpu", "float32")
    assert kind.name == "chat" and type(captioner.processor).__name__ == processor
    images = images_in(tmp_path, ["red", "blue", "green"])
    report = caption_images(images, captioner, "describe this {name} image", "overwrite", batch_size=3,
                            max_new_tokens=4)
    captions = [read_caption(image) for image in images]
    assert report.written == images and all(captions)
    assert not any(token in caption for caption in captions for token in CHAT_TOKENS)


@pytest.mark.skipif("torchvision_installed()", reason="with torchvision the processor loads as it is")
def test_without_torchvision_the_processor_as_transformers_loads_it_is_refused_naming_the_package(qwen):
    from transformers import AutoProcessor

    from modules.autolabel.transformers_models import load_pretrained

    folder, _, _ = qwen
    with pytest.raises(LabelModelError) as refused:
        load_pretrained(AutoProcessor, folder, "processor")
    assert str(refused.value) == (f"--model: {folder}: its processor needs a package that is not installed "
                                  "(Qwen2VLVideoProcessor requires the Torchvision library but it was not found in "
                                  "your environment)")
