"""CLIPSeg (CLIPSegForImageSegmentation, model_type clipseg): the probability that the text prompt
is at each pixel, from the model's logits brought up to the image's size (bilinear) and a sigmoid."""

from __future__ import annotations

from pathlib import Path

from modules.autolabel.maskers import MaskerKind, register
from modules.autolabel.model_folder import LabelModelError, model_config
from modules.autolabel.transformers_models import load_model, load_pretrained, model_inputs


def takes(folder: Path) -> bool:
    try:
        return model_config(folder)["model_type"] == "clipseg"
    except LabelModelError:
        return False


class ClipSegMasker:
    def __init__(self, folder: str | Path, device: str = "cpu", dtype: str = "float32"):
        from transformers import AutoProcessor, CLIPSegForImageSegmentation

        self.processor = load_pretrained(AutoProcessor, Path(folder), "processor")
        self.model = load_model(CLIPSegForImageSegmentation, Path(folder), device, dtype)

    def probabilities(self, images: list, prompt: str) -> list:
        """Per image, an (height, width) float array in [0, 1] at the image's own size."""
        import numpy as np
        import torch
        import torch.nn.functional as F

        batch = self.processor(text=[prompt] * len(images), images=images, return_tensors="pt", padding=True)
        with torch.inference_mode():
            logits = self.model(**model_inputs(batch, self.model)).logits
        logits = logits.float().reshape(len(images), 1, *logits.shape[-2:])  # (a batch of one comes squeezed)
        maps = []
        for image, image_logits in zip(images, logits):
            resized = F.interpolate(image_logits[None], size=(image.height, image.width), mode="bilinear",
                                    align_corners=False)[0, 0]
            maps.append(np.asarray(torch.sigmoid(resized).cpu()))
        return maps


register(MaskerKind(name="clipseg", describes="CLIPSeg (model_type clipseg, CLIPSegForImageSegmentation; masks what "
                    "--prompt names)", takes=takes, load=ClipSegMasker, takes_prompt=True, order=10))
