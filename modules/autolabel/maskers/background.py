"""Background removal with an ONNX segmentation model in the Transformers.js folder layout
(briaai/RMBG-1.4 and RMBG-2.0, the onnx-community BiRefNet and ISNet exports): `onnx/model.onnx`
(or `model.onnx`) beside `preprocessor_config.json`, run with ONNX Runtime. The mask is the
foreground (white: train on the subject, not its background); it takes no prompt.

The image is prepared as the folder's preprocessor config says (resized to its `size`, rescaled by
`rescale_factor`, normalised by `image_mean` / `image_std`, NCHW); the first output's map is brought
to [0, 1] the way the two kinds of model need: logits (values outside [0, 1], BiRefNet / RMBG-2.0)
through a sigmoid, a probability map (RMBG-1.4 / ISNet) stretched from its minimum to its maximum, as
their model cards do; then resized to the image (bilinear)."""

from __future__ import annotations

import json
from pathlib import Path

from modules.autolabel.maskers import MaskerKind, register
from modules.autolabel.model_folder import LabelModelError
from modules.autolabel.onnx_session import onnx_session

PREPROCESSOR = "preprocessor_config.json"
MODEL_FILES = ("onnx/model.onnx", "model.onnx")
MAX_SIZE = 4096  # the model's input side, from its config: bounded so a wrong config cannot exhaust memory


def model_file(folder: Path) -> Path | None:
    return next((folder / name for name in MODEL_FILES if (folder / name).is_file()), None)


def takes(folder: Path) -> bool:
    return model_file(folder) is not None and (folder / PREPROCESSOR).is_file()


def _number(value, what: str, where: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LabelModelError(f"{where}: {what} must be a number, not {value!r}", field="--model")
    return float(value)


def read_preprocessing(path: Path) -> dict:
    """{"size": (width, height), "scale": float, "mean": [3], "std": [3]} from a preprocessor config;
    one message naming the file and the field when it cannot be used."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise LabelModelError(f"{path} cannot be read as JSON ({error})", field="--model") from None
    if not isinstance(config, dict):
        raise LabelModelError(f"{path} is not a preprocessor config (an object)", field="--model")
    size = config.get("size", {})
    if isinstance(size, dict):
        width, height = size.get("width", size.get("shortest_edge")), size.get("height", size.get("shortest_edge"))
    else:
        width = height = size
    width, height = (_number(v, "size", path) for v in (width, height))
    if not (1 <= width <= MAX_SIZE and 1 <= height <= MAX_SIZE) or width != int(width) or height != int(height):
        raise LabelModelError(f"{path}: size must be whole numbers of pixels from 1 to {MAX_SIZE} "
                              f"(got {width:g} x {height:g})", field="--model")
    scale = _number(config.get("rescale_factor", 1 / 255), "rescale_factor", path) \
        if config.get("do_rescale", True) else 1.0
    mean, std = [0.0] * 3, [1.0] * 3
    if config.get("do_normalize", True):
        mean, std = config.get("image_mean", mean), config.get("image_std", std)
        for name, values in (("image_mean", mean), ("image_std", std)):
            if not isinstance(values, list) or len(values) != 3:
                raise LabelModelError(f"{path}: {name} must list 3 numbers (R, G, B), not {values!r}",
                                      field="--model")
        mean = [_number(v, "image_mean", path) for v in mean]
        std = [_number(v, "image_std", path) for v in std]
        if any(s <= 0 for s in std):
            raise LabelModelError(f"{path}: image_std must be above 0 (got {std})", field="--model")
    return {"size": (int(width), int(height)), "scale": scale, "mean": mean, "std": std}


def to_unit_range(values):
    """A map of logits through a sigmoid; a map already in [0, 1] stretched to it (min to max)."""
    import numpy as np

    values = values.astype(np.float32)
    if values.min() < 0.0 or values.max() > 1.0:
        return 1.0 / (1.0 + np.exp(-values))
    low, high = float(values.min()), float(values.max())
    return (values - low) / (high - low) if high > low else np.zeros_like(values)


class BackgroundMasker:
    def __init__(self, folder: str | Path, device: str = "cpu", _dtype: str = "float32"):
        folder = Path(folder)
        self.preprocessing = read_preprocessing(folder / PREPROCESSOR)
        self.session = onnx_session(model_file(folder), device, "background removal")
        self.input_name = self.session.get_inputs()[0].name

    def pixels(self, image):
        """(3, height, width) float32 as the preprocessor config prepares it."""
        import numpy as np
        from PIL import Image

        prep = self.preprocessing
        resized = image.convert("RGB").resize(prep["size"], Image.BILINEAR)
        array = np.asarray(resized, dtype=np.float32) * prep["scale"]
        array = (array - np.array(prep["mean"], dtype=np.float32)) / np.array(prep["std"], dtype=np.float32)
        return array.transpose(2, 0, 1)

    def probabilities(self, images: list, _prompt: str) -> list:
        import numpy as np
        from PIL import Image

        maps = []
        for image in images:  # one at a time: many exports take a batch of one only
            output = self.session.run(None, {self.input_name: self.pixels(image)[None]})[0]
            unit = to_unit_range(np.asarray(output).reshape(output.shape[-2:]))
            resized = Image.fromarray(unit, mode="F").resize(image.size, Image.BILINEAR)
            maps.append(np.clip(np.asarray(resized, dtype=np.float32), 0.0, 1.0))
        return maps


register(MaskerKind(name="background", describes=f"background removal (an ONNX model, {' or '.join(MODEL_FILES)}, "
                    f"with {PREPROCESSOR}: RMBG-1.4/2.0, BiRefNet, ISNet exports; masks the foreground, no prompt)",
                    takes=takes, load=BackgroundMasker, takes_prompt=False, order=20))
