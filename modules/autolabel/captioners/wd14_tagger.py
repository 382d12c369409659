"""WD14-style taggers (SmilingWolf's wd-*-tagger ONNX models and taggers in their layout): a folder
with `model.onnx` and `selected_tags.csv` (tag_id, name, category, count), run with ONNX Runtime.
The caption is a comma-separated tag list: character tags scoring at least 0.85, then general tags
scoring at least 0.35 (the thresholds the models' own demo and most trainers' taggers default to),
each group by score, highest first; rating tags are left out (they describe the image's audience,
not its content). Underscores become spaces except in kaomoji such as `^_^`.

As the models were trained: the image is composited on white, padded to a square with white,
resized (bicubic) to the model's input size, and given as BGR float 0..255 in NHWC."""

from __future__ import annotations

import csv
from pathlib import Path

from modules.autolabel.captioners import CaptionerKind, register
from modules.autolabel.model_folder import LabelModelError
from modules.autolabel.onnx_session import onnx_session

MODEL_FILE = "model.onnx"
TAGS_FILE = "selected_tags.csv"
GENERAL_THRESHOLD = 0.35
CHARACTER_THRESHOLD = 0.85
CATEGORIES = {"general": 0, "character": 4, "rating": 9}  # selected_tags.csv's category numbers
# kaomoji tags keep their underscores (the list the WD14 models' demo keeps)
KAOMOJI = {"0_0", "(o)_(o)", "+_+", "+_-", "._.", "<o>_<o>", "<|>_<|>", "=_=", ">_<", "3_3", "6_9", ">_o", "@_@",
           "^_^", "o_o", "u_u", "x_x", "|_|", "||_||"}


def takes(_config: dict, folder: Path) -> bool:
    return (folder / MODEL_FILE).is_file() and (folder / TAGS_FILE).is_file()


def read_tags(path: Path) -> tuple[list[str], list[int]]:
    """(tag names, their categories) in the model's output order; one message naming the file and
    line when it is not a tag table."""
    names, categories = [], []
    try:
        with open(path, newline="", encoding="utf-8") as table:
            for line, row in enumerate(csv.DictReader(table), start=2):
                try:
                    names.append(row["name"])
                    categories.append(int(row["category"]))
                except (KeyError, TypeError, ValueError):
                    raise LabelModelError(f"{path}, line {line}: a tag row needs a name and a whole-number "
                                          f"category (got {row})", field="--model") from None
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise LabelModelError(f"{path} cannot be read as a tag table ({error})", field="--model") from None
    if not names:
        raise LabelModelError(f"{path} lists no tags", field="--model")
    return names, categories


def spoken(tag: str) -> str:
    return tag if tag in KAOMOJI else tag.replace("_", " ")


def square_pixels(image, size: int):
    """(size, size, 3) BGR float32 of `image` as the taggers were trained to see it."""
    import numpy as np
    from PIL import Image

    rgba = image.convert("RGBA")
    flat = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    flat.alpha_composite(rgba)
    side = max(flat.size)
    square = Image.new("RGB", (side, side), (255, 255, 255))
    square.paste(flat.convert("RGB"), ((side - flat.width) // 2, (side - flat.height) // 2))
    square = square.resize((size, size), Image.BICUBIC)
    return np.asarray(square, dtype=np.float32)[:, :, ::-1]


class WD14Tagger:
    def __init__(self, folder: Path, device: str, _dtype: str):
        self.names, self.categories = read_tags(folder / TAGS_FILE)
        self.session = onnx_session(folder / MODEL_FILE, device, "a WD14 tagger")
        model_input = self.session.get_inputs()[0]
        self.input_name = model_input.name
        self.size = model_input.shape[1]
        if not isinstance(self.size, int) or model_input.shape[2] != self.size or model_input.shape[3] != 3:
            raise LabelModelError(f"{folder / MODEL_FILE} takes {model_input.shape}: a WD14 tagger takes "
                                  "(batch, size, size, 3) images", field="--model")
        outputs = self.session.get_outputs()[0].shape[-1]
        if isinstance(outputs, int) and outputs != len(self.names):
            raise LabelModelError(f"{folder / MODEL_FILE} scores {outputs} tags but {folder / TAGS_FILE} lists "
                                  f"{len(self.names)}", field="--model")

    def scores(self, images: list):
        """(images, tags) scores, 0..1."""
        import numpy as np

        batch = np.stack([square_pixels(image, self.size) for image in images])
        return self.session.run(None, {self.input_name: batch})[0]

    def caption(self, images: list, _prompts: list[str], _max_new_tokens: int) -> list[str]:
        captions = []
        for scores in self.scores(images):
            chosen = []
            for category, threshold in ((CATEGORIES["character"], CHARACTER_THRESHOLD),
                                        (CATEGORIES["general"], GENERAL_THRESHOLD)):
                found = [(float(s), n) for s, n, c in zip(scores, self.names, self.categories)
                         if c == category and s >= threshold]
                chosen += [spoken(name) for _, name in sorted(found, key=lambda pair: -pair[0])]
            captions.append(", ".join(chosen))
        return captions


register(CaptionerKind(name="wd14", describes=f"a WD14-style tagger (a folder with {MODEL_FILE} and {TAGS_FILE}; "
                       "run with ONNX Runtime; takes no prompt)", takes=takes, load=WD14Tagger, needs_config=False,
                       order=50))
