"""BLIP and BLIP-2 (BlipForConditionalGeneration, Blip2ForConditionalGeneration): the prompt, where
given, is the caption's first words ("a photography of"), and the caption is returned with them,
as BLIP writes it."""

from __future__ import annotations

from pathlib import Path

from modules.autolabel.captioners import CaptionerKind, register
from modules.autolabel.transformers_models import load_model, load_pretrained, model_inputs


TAKES = {"blip": "BlipForConditionalGeneration", "blip-2": "Blip2ForConditionalGeneration"}  # model_type: class


def takes(config: dict, _folder: Path) -> bool:
    return TAKES.get(config.get("model_type")) in (config.get("architectures") or [])


class BlipCaptioner:
    def __init__(self, folder: Path, device: str, dtype: str):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = load_pretrained(AutoProcessor, folder, "processor")
        self.model = load_model(AutoModelForImageTextToText, folder, device, dtype)

    def caption(self, images: list, prompts: list[str], max_new_tokens: int) -> list[str]:
        import torch

        if len(set(prompts)) > 1:  # a prompt is a prefix: padded between it and the caption, it would break
            return [caption for image, prompt in zip(images, prompts)
                    for caption in self.caption([image], [prompt], max_new_tokens)]
        text = prompts if prompts[0] else None
        batch = self.processor(images=images, text=text, return_tensors="pt", padding=True)
        with torch.inference_mode():
            tokens = self.model.generate(**model_inputs(batch, self.model), max_new_tokens=max_new_tokens)
        return [caption.strip() for caption in self.processor.batch_decode(tokens, skip_special_tokens=True)]


register(CaptionerKind(name="blip", describes="BLIP, BLIP-2 (model_type blip, blip-2)",
                       takes=takes, load=BlipCaptioner, default_prompt="", order=10))
