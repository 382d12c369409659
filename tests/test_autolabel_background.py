"""Background-removal masks (issue 30 item 3): a folder in the Transformers.js layout (onnx/model.onnx
+ preprocessor_config.json, as briaai's RMBG-1.4/2.0 and the BiRefNet exports ship) is told by its
files, run with ONNX Runtime on the image as its preprocessor config prepares it, and the foreground
becomes the white of `<image>-masklabel.png`, with no prompt. The tiny models
(modules/autolabel/tiny_models.py) call a pixel foreground where it is red: one scores logits
(BiRefNet-like, through a sigmoid), one a probability map (RMBG-1.4-like, stretched min to max)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from modules.autolabel.mask_folder import mask_images
from modules.autolabel.maskers import masker_kind_for
from modules.autolabel.model_folder import LabelModelError
from modules.data.masks import mask_path


def red_square_on_blue(path, size=(48, 40)):
    image = Image.new("RGB", size, (0, 0, 255))
    image.paste((255, 0, 0), (10, 8, 30, 28))
    image.save(path)
    return path


@pytest.mark.parametrize("logits", [True, False], ids=["logits", "probabilities"])
def test_the_foreground_is_the_white_of_the_mask(tmp_path, logits):
    from modules.autolabel.tiny_models import make_tiny_background

    folder = make_tiny_background(tmp_path / "model", logits=logits)
    kind = masker_kind_for(folder)
    assert kind.name == "background" and not kind.takes_prompt
    masker = kind.load(folder, "cpu", "float32")
    (tmp_path / "images").mkdir()
    image = red_square_on_blue(tmp_path / "images" / "a.png")
    report = mask_images([image], masker, "", threshold=0.4, takes_prompt=False)
    assert report.written == [image]
    with Image.open(mask_path(image)) as mask:
        assert mask.size == (48, 40) and mask.mode == "L"
        pixels = np.asarray(mask)
    assert pixels[18, 20] == 255 and pixels[2, 2] == 0 and pixels[38, 46] == 0  # the square, the background
    assert abs(int((pixels == 255).sum()) - 20 * 20) <= 2 * 20 * 4  # the square, give or take its resized edges


def test_clipseg_still_needs_its_prompt_and_a_bad_preprocessor_config_is_named(tiny_labellers, tmp_path):
    import shutil

    (tmp_path / "images").mkdir()
    red_square_on_blue(tmp_path / "images" / "a.png")
    with pytest.raises(Exception, match="say what to mask"):
        mask_images([tmp_path / "images" / "a.png"], object(), "", takes_prompt=True)
    broken = tmp_path / "model"
    shutil.copytree(tiny_labellers("background"), broken)
    config = json.loads((broken / "preprocessor_config.json").read_text())
    config["image_std"] = [1.0, 0.0, 1.0]
    (broken / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(LabelModelError, match=r"preprocessor_config.json: image_std must be above 0"):
        masker_kind_for(broken).load(broken, "cpu", "float32")
    config["image_std"], config["size"] = [1.0, 1.0, 1.0], {"width": 100000, "height": 32}
    (broken / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(LabelModelError, match=r"size must be whole numbers of pixels from 1 to 4096"):
        masker_kind_for(broken).load(broken, "cpu", "float32")
    (broken / "onnx" / "model.onnx").unlink()
    with pytest.raises(LabelModelError, match="holds no model config, which no masker takes; known kinds: clipseg"):
        masker_kind_for(broken)
