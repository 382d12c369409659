"""Textual-inversion embeddings (`embeddings`): new tokens for the text encoders, trained alone
(`method.type: embedding`) or alongside an adapter or fine-tune (OneTrainer's "additional
embeddings"), or loaded from a file and used frozen. modules/methods/embedding.py trains them."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from modules.config.limits import MAX_LEARNING_RATE
from modules.config.strict import StrictModel


class EmbeddingConfig(StrictModel):
    placeholder: str = Field(..., min_length=1, description="The word captions and sample prompts use for "
                             "this embedding, e.g. <my-style>: a new token (kohya's token_string). Lowercase, "
                             "no spaces, and unlike any real word: CLIP tokenizers lowercase prompts and match "
                             "it inside longer words too.")
    init_text: str = Field("*", min_length=1, description="Text whose token embeddings the new vectors start "
                           "from, one token per vector (repeated when it has fewer tokens than vectors; kohya's "
                           "init_word).")
    vectors: int = Field(1, ge=1, le=75, description="Vectors (tokens) the placeholder stands for: more "
                         "learns more detail and takes more of the 75-token prompt (kohya's "
                         "num_vectors_per_token). A file in `path` brings its own count.")
    train: bool = Field(True, description="Train this embedding; off: use it frozen from `path` (its "
                        "placeholder still works in captions and sample prompts).")
    path: str | None = Field(None, description="An embedding file (.safetensors, A1111/ComfyUI layout: "
                             "emb_params for SD1.5; clip_l/clip_g for SDXL; clip_l/t5xxl for FLUX.1, plus "
                             "clip_g for SD3; t5xxl for Chroma; qwen3_4b for Z-Image and FLUX.2 klein 4B, qwen3_8b "
                             "for klein 9B; qwen25_7b for Qwen-Image; qwen3_06b for Anima; qwen3vl_4b for Krea-2 and "
                             "FIBO-2; smollm3_3b for FIBO Edit) to start from, or to use frozen when train is off.")
    learning_rate: float | None = Field(None, gt=0, le=MAX_LEARNING_RATE,
        description="This embedding's learning rate; empty: "
                                        "optimizer.lr.")

    @field_validator("placeholder")
    @classmethod
    def _one_lowercase_word(cls, value: str) -> str:
        if re.search(r"\s", value):
            raise ValueError(f"{value!r} has a space: a placeholder is one word")
        if value != value.lower():
            raise ValueError(f"{value!r} has capitals: CLIP tokenizers lowercase prompts, so write "
                             f"{value.lower()!r}")
        return value

    @property
    def file_stem(self) -> str:
        """The placeholder as a file name part: <my-style> -> my-style."""
        return re.sub(r"[^\w.-]+", "", self.placeholder).strip(".") or "embedding"


def check_embeddings(embeddings: list[EmbeddingConfig], method_type: str,
                     method_trains_them: bool) -> list[tuple[str, tuple]]:
    """Problems of the embedding list as a whole: (message, path below the config root);
    `method_trains_them`: the main method trains the embeddings (its trains_embeddings trait)."""
    problems = []
    stems: dict[str, int] = {}
    for index, embedding in enumerate(embeddings):
        if not embedding.train and not embedding.path:
            problems.append(("train is off and no path is given: a frozen embedding comes from a file",
                             ("embeddings", index, "path")))
        earlier = stems.setdefault(embedding.file_stem, index)
        if earlier != index:
            problems.append((f"{embedding.placeholder!r} names the same file as embeddings[{earlier}] "
                             f"({embeddings[earlier].placeholder!r}): give it another placeholder",
                             ("embeddings", index, "placeholder")))
    for index, embedding in enumerate(embeddings):
        for other in embeddings[index + 1:]:
            if other.placeholder in embedding.placeholder or embedding.placeholder in other.placeholder:
                problems.append((f"{embedding.placeholder!r} and {other.placeholder!r}: one contains the other, "
                                 "so captions could not tell them apart", ("embeddings", index, "placeholder")))
    if method_trains_them and not any(e.train for e in embeddings):
        problems.append((f"method.type is {method_type}: add an embedding with train on to embeddings "
                         "(placeholder, init_text, vectors)", ("embeddings",)))
    return problems
