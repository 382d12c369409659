"""Chat vision-language models (Qwen2-VL/Qwen2.5-VL/Qwen3-VL, LLaVA, and any image-text-to-text
checkpoint whose processor has a chat template): the prompt is the user's message beside the image,
and the caption is the answer, without the prompt. The processor loads without torchvision too
(modules/autolabel/image_only_processor.py: Qwen-VL processors would otherwise want its video
processor)."""

from __future__ import annotations

from pathlib import Path

from modules.autolabel.captioners import CaptionerKind, register
from modules.autolabel.image_only_processor import load_processor
from modules.autolabel.model_folder import has_chat_template
from modules.autolabel.transformers_models import load_model, model_inputs


def takes(config: dict, folder: Path) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return config.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and has_chat_template(folder)


class ChatCaptioner:
    def __init__(self, folder: Path, device: str, dtype: str):
        from transformers import AutoModelForImageTextToText

        self.processor = load_processor(folder)
        self.processor.tokenizer.padding_side = "left"  # new tokens follow every prompt of a batch directly
        self.model = load_model(AutoModelForImageTextToText, folder, device, dtype)

    def caption(self, images: list, prompts: list[str], max_new_tokens: int) -> list[str]:
        import torch

        texts = [self.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}],
            add_generation_prompt=True, tokenize=False) for prompt in prompts]
        batch = self.processor(images=images, text=texts, return_tensors="pt", padding=True)
        with torch.inference_mode():
            tokens = self.model.generate(**model_inputs(batch, self.model), max_new_tokens=max_new_tokens)
        answers = tokens[:, batch["input_ids"].shape[1]:]
        return [caption.strip() for caption in self.processor.batch_decode(answers, skip_special_tokens=True)]


register(CaptionerKind(name="chat", describes="an image-text-to-text model whose processor has a chat template "
                       "(Qwen2-VL, Qwen2.5-VL, LLaVA, ...)", takes=takes, load=ChatCaptioner,
                       default_prompt="Describe this image in one sentence.", order=100))
