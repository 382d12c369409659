"""WD14-style tagging (issue 30 item 2): a tagger folder (model.onnx + selected_tags.csv) is told by
its files, run with ONNX Runtime on the images as the taggers were trained to see them (white
composited and padded square, bicubic, BGR 0..255, NHWC), and captions are its tags over the
thresholds: characters first, each group by score, ratings left out, underscores spoken except in
kaomoji. The tiny tagger (modules/autolabel/tiny_models.py) scores tags from the mean BGR colour, so
every expected caption follows from its table."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from modules.autolabel.caption_folder import caption_images
from modules.autolabel.captioners import kind_for
from modules.autolabel.captioners.wd14_tagger import square_pixels
from modules.autolabel.images import read_caption
from modules.autolabel.model_folder import LabelModelError


@pytest.fixture(scope="module")
def tagger_folder(tiny_labellers):
    return tiny_labellers("wd14")


def test_the_tagger_captions_a_folder_with_its_tags_over_the_thresholds(tagger_folder, tmp_path):
    kind = kind_for(tagger_folder)
    assert kind.name == "wd14" and kind.default_prompt == ""
    tagger = kind.load(tagger_folder, "cpu", "auto")
    images = []
    for name, colour in (("red", (255, 0, 0)), ("green", (0, 255, 0)), ("blue", (0, 0, 255))):
        images.append(tmp_path / f"{name}.png")
        Image.new("RGB", (32, 32), colour).save(images[-1])
    report = caption_images(images, tagger, kind.default_prompt, "overwrite", batch_size=2, max_new_tokens=0)
    assert report.written == images
    assert [read_caption(image) for image in images] == [
        "red background, ^_^, simple background",
        "hatsune miku, ^_^, simple background",  # the character first
        "blue background, ^_^, simple background",
    ]
    scores = tagger.scores([Image.open(images[1])])[0]
    assert scores[tagger.names.index("general")] > 0.99  # a rating over any threshold is still left out


def test_images_are_seen_white_composited_padded_square_and_bgr():
    wide = Image.new("RGBA", (40, 20), (255, 0, 0, 255))
    wide.putpixel((0, 10), (0, 0, 255, 0))  # transparent: white once composited
    pixels = square_pixels(wide, 40)
    assert pixels.shape == (40, 40, 3) and pixels.dtype == np.float32
    assert pixels[2, 20].tolist() == [255, 255, 255]  # the padding above
    assert pixels[20, 20].tolist() == [0, 0, 255]  # red as B, G, R
    assert pixels[20, 0].tolist() == [255, 255, 255]


def test_a_broken_tag_table_or_model_is_named(tagger_folder, tmp_path):
    import shutil

    broken = tmp_path / "tagger"
    shutil.copytree(tagger_folder, broken)
    (broken / "selected_tags.csv").write_text("tag_id,name,category,count\n0,red,lots,1\n", encoding="utf-8")
    with pytest.raises(LabelModelError, match=r"selected_tags.csv, line 2: a tag row needs a name and a whole-number "
                                              r"category"):
        kind_for(broken).load(broken, "cpu", "auto")
    (broken / "selected_tags.csv").write_text("tag_id,name,category,count\n0,red,0,1\n", encoding="utf-8")
    with pytest.raises(LabelModelError, match=r"model.onnx scores 8 tags but .*selected_tags.csv lists 1"):
        kind_for(broken).load(broken, "cpu", "auto")
    (broken / "model.onnx").write_bytes(b"not an onnx file")
    with pytest.raises(LabelModelError, match=r"model.onnx cannot be loaded by ONNX Runtime"):
        kind_for(broken).load(broken, "cpu", "auto")
    (broken / "model.onnx").unlink()  # no longer a tagger folder: the transformers message
    with pytest.raises(LabelModelError, match="has no config.json"):
        kind_for(broken)
