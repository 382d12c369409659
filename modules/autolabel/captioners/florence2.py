"""Florence-2 (transformers' Florence2ForConditionalGeneration, model_type florence2): the prompt is
one of its task tokens; for captions `<CAPTION>`, `<DETAILED_CAPTION>` or `<MORE_DETAILED_CAPTION>`,
which its processor turns into the question the model was trained on ("Describe in detail what is
shown in the image."). Beam search (3 beams), as Microsoft's examples generate; the caption is the
decoded answer without its special tokens (what the processor's `pure_text` parse gives)."""

from __future__ import annotations

from pathlib import Path

from modules.autolabel.captioners import CaptionerKind, register
from modules.autolabel.transformers_models import load_model, load_pretrained, model_inputs

CAPTION_TASKS = ("<CAPTION>", "<DETAILED_CAPTION>", "<MORE_DETAILED_CAPTION>")
BEAMS = 3


def takes(config: dict, _folder: Path) -> bool:
    return config.get("model_type") == "florence2"


class Florence2Captioner:
    def __init__(self, folder: Path, device: str, dtype: str):
        from transformers import AutoProcessor, Florence2ForConditionalGeneration

        self.processor = load_pretrained(AutoProcessor, folder, "processor")
        self.model = load_model(Florence2ForConditionalGeneration, folder, device, dtype)

    def caption(self, images: list, prompts: list[str], max_new_tokens: int) -> list[str]:
        import torch

        batch = self.processor(images=images, text=prompts, return_tensors="pt", padding=True)
        with torch.inference_mode():
            tokens = self.model.generate(**model_inputs(batch, self.model), max_new_tokens=max_new_tokens,
                                         num_beams=BEAMS, do_sample=False)
        return [caption.strip() for caption in self.processor.batch_decode(tokens, skip_special_tokens=True)]


register(CaptionerKind(name="florence2", describes="Florence-2 (model_type florence2; the prompt is a task token: "
                       + ", ".join(CAPTION_TASKS) + ")",
                       takes=takes, load=Florence2Captioner, default_prompt="<DETAILED_CAPTION>", order=10))
