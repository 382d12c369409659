"""Florence-2 captions (issue 30 item 2) with a tiny random Florence-2 built offline from its
transformers config (modules/autolabel/tiny_models.py): its kind is chosen from the folder's config,
its task token is the prompt, and a batch captions each image as it would alone (the padding of
the task prompts and beam search keep images apart)."""

from __future__ import annotations

from PIL import Image

from modules.autolabel.caption_folder import caption_images
from modules.autolabel.captioners import kind_for
from modules.autolabel.images import read_caption
from modules.data.synthetic_images import write_shape_images


def test_florence2_captions_every_image_with_its_task_token_and_a_batch_equals_each_alone(tiny_labellers, tmp_path):
    folder = tiny_labellers("florence2")
    kind = kind_for(folder)
    assert kind.name == "florence2" and kind.default_prompt == "<DETAILED_CAPTION>"
    captioner = kind.load(folder, "cpu", "float32")
    images = write_shape_images(tmp_path, count=3, width=48, height=40)
    report = caption_images(images, captioner, kind.default_prompt, "overwrite", batch_size=3, max_new_tokens=5)
    assert report.written == images
    batched = [read_caption(image) for image in images]
    assert all(batched) and not any("<" in caption for caption in batched)  # no task or special tokens left
    pictures = [Image.open(path).convert("RGB") for path in images]
    alone = [captioner.caption([picture], [kind.default_prompt], 5)[0] for picture in pictures]
    assert alone == batched
    other = captioner.caption(pictures[:1], ["<MORE_DETAILED_CAPTION>"], 5)[0]
    assert other  # another caption task: its own question, still a caption
