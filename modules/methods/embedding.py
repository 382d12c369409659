"""The embedding method: textual inversion. Each entry of `embeddings` becomes new tokens in every
text encoder of the family (SD1.5: CLIP-L; SDXL: CLIP-L and CLIP-G; SD3: CLIP-L, CLIP-G and T5;
FLUX.1: CLIP-L and T5; Chroma: T5; Z-Image and FLUX.2 [klein]: Qwen3; Qwen-Image: Qwen2.5-VL's
language model; Anima: Qwen3 0.6B; Krea-2 and FIBO-2: Qwen3-VL-4B's language model; FIBO Edit: SmolLM3;
FLUX.1 Kontext: FLUX.1's; Qwen-Image-Edit(-Plus): Qwen2.5-VL; the Wan families: UMT5-XXL;
the family's `embedding_slots`), initialised
from its init text or read from its file; only those vectors train, the model stays frozen.

It is the main method with `method.type: embedding`, and a companion of the adapter or fine-tune
method whenever `embeddings` is not empty (build_methods adds it): trained embeddings train beside
the adapter (OneTrainer's "additional embeddings"), frozen ones just make their placeholder work
in captions and sample prompts. Files are saved in the A1111/ComfyUI layout (embedding_files.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from modules.config.errors import ConfigError
from modules.config.train_config import TrainConfig
from modules.methods.base import TrainingMethod
from modules.methods.embedding_files import read_embedding_file, write_embedding_file
from modules.model.components.embedding_tokens import (
    AddedTokenRows,
    add_tokens,
    expand_placeholders,
    init_vectors,
    placeholder_tokens,
    token_embedding,
)


class EmbeddingMethod(TrainingMethod):
    name = "embedding"
    state_prefix = "embedding."

    def __init__(self, trainer):
        super().__init__(trainer)
        self.embeddings = list(self.config.embeddings)
        self.slots = dict(self.family.embedding_slots)  # text part -> (tokenizer attribute, file key)
        if not self.slots:
            from modules.config.families import family_names, get_family_class

            able = [get_family_class(n).label for n in family_names() if get_family_class(n).embedding_slots]
            raise ConfigError([f"embeddings: the {self.family.label} family takes no textual-inversion embeddings "
                               f"here (families that do: {', '.join(able)}); remove the embeddings"])
        self.vectors: list[dict[str, nn.Parameter]] = []  # per embedding: text part -> [vectors, dim]
        self.hooks: list[AddedTokenRows] = []

    def trained_parts(self) -> list[str]:
        return list(self.slots) if any(e.train for e in self.embeddings) else []

    def text_cache_allowed(self) -> bool:
        # captions with a placeholder encode differently than the cache's key (the text encoder's
        # weights and the caption) can tell, trained or not
        return not self.embeddings

    # --- setup -------------------------------------------------------------------------------

    def setup(self) -> None:
        try:
            self._setup()
        except ValueError as error:
            raise ConfigError([str(error)]) from None

    def _setup(self) -> None:
        family = self.family
        self.slots = dict(family.embedding_slots)  # the loaded model's (FLUX.2's key follows its encoder's size)
        if not self.slots:  # a variant the config could not tell apart before the load (FLUX.2 [dev])
            raise ConfigError([f"embeddings: this {family.label} model ({self.config.model.base}) takes no "
                               "textual-inversion embeddings here; remove the embeddings"])
        tokenizers = {part: getattr(family, attribute) for part, (attribute, _key) in self.slots.items()}
        tables = {part: token_embedding(family.parts[part]) for part in self.slots}
        keys = {part: key for part, (_attribute, key) in self.slots.items()}
        starts = []
        for index, embedding in enumerate(self.embeddings):
            where = f"embeddings[{index}]"
            if embedding.path:
                start = read_embedding_file(embedding.path, keys, {p: t.embedding_dim for p, t in tables.items()},
                                            f"{where}.path")
            else:  # the init text is tokenized before any placeholder joins the vocabulary
                start = {part: init_vectors(tokenizers[part], tables[part].weight, embedding.init_text,
                                            embedding.vectors, f"{where}.init_text") for part in self.slots}
            starts.append(start)
        template = family.tokenize([""])  # the prompt template around a caption, before any new token
        first_ids: dict[str, int] = {}
        added: dict[int, int] = {}  # id(tokenizer) -> its first new id (a tokenizer shared by parts gets them once)
        new_ids: list[set[int]] = [set() for _ in self.embeddings]  # per embedding: its ids in every tokenizer
        for part, tokenizer in tokenizers.items():
            if id(tokenizer) not in added:
                ids = []
                for index, (embedding, start) in enumerate(zip(self.embeddings, starts)):
                    tokens = placeholder_tokens(embedding.placeholder, next(iter(start.values())).shape[0])
                    ids += add_tokens(tokenizer, tokens, f"embeddings[{index}].placeholder")
                    new_ids[index].update(ids[-len(tokens):])
                added[id(tokenizer)] = ids[0]
            first_ids[part] = added[id(tokenizer)]
        self._check_template(template, tokenizers)
        for embedding, start in zip(self.embeddings, starts):
            self.vectors.append({part: nn.Parameter(tensor.to(self.device), requires_grad=embedding.train)
                                 for part, tensor in start.items()})
        self._check_reach(new_ids)
        for part in self.slots:
            self.hooks.append(AddedTokenRows(tables[part], first_ids[part], [v[part] for v in self.vectors]))

    def _check_template(self, before: dict[str, torch.Tensor], tokenizers: dict) -> None:
        """The new tokens leave the family's prompt template as it tokenized: a placeholder that is
        part of a template word (`ser` of `user`) would split it, and the template's token count is
        load-bearing (Qwen-Image drops its first 34 tokens; the models learned the template's exact tokens)."""
        after = self.family.tokenize([""])
        if all(torch.equal(before[key], after[key]) for key in before):
            return
        texts = [tokenizer.decode(ids[0].tolist()) for tokenizer in tokenizers.values()
                 for key, ids in before.items() if key.startswith("input_ids") and int(ids.max()) < len(tokenizer)]
        culprits = [f"embeddings[{i}].placeholder {e.placeholder!r}" for i, e in enumerate(self.embeddings)
                    if any(e.placeholder in text for text in texts)] or ["embeddings[].placeholder"]
        raise ValueError(f"{', '.join(culprits)}: the placeholder is part of the {self.family.label} prompt template "
                         f"around each caption, so its new token would split the template's words and shift its "
                         f"tokens; choose a placeholder unlike any word, e.g. <my-style>")

    def _check_reach(self, new_ids: list[set[int]]) -> None:
        """Each placeholder's tokens reach the encoders through what the family does to a caption (FIBO
        Edit puts plain text in a JSON object, FIBO-2 reserializes a JSON caption): a placeholder the
        caption handling rewrote (a non-ASCII one escaped, a quote in JSON) would never be looked up and
        so never train, without the first-step guard seeing it (it guards the looked-up ones)."""
        for index, embedding in enumerate(self.embeddings):
            for caption in self.family.embedding_probe_captions(embedding.placeholder):
                tokens = self.family.tokenize(self.expand_captions([caption]))
                seen = {int(i) for key, ids in tokens.items() if key.startswith("input_ids") for i in ids.flatten()}
                if not new_ids[index] <= seen:
                    raise ValueError(f"embeddings[{index}].placeholder {embedding.placeholder!r}: the {self.family.label} "
                                     f"caption {caption!r} reaches the text encoder without the placeholder's tokens "
                                     f"(the family rewrites it before tokenizing); choose a placeholder of ASCII "
                                     f"letters, digits and <>-_, e.g. <my-style>")

    def vector_counts(self) -> dict[str, int]:
        return {e.placeholder: next(iter(v.values())).shape[0] for e, v in zip(self.embeddings, self.vectors)}

    def expand_captions(self, captions: list[str]) -> list[str]:
        counts = self.vector_counts()
        return [expand_placeholders(caption, counts) for caption in captions]

    # --- what trains -------------------------------------------------------------------------

    def _trained(self) -> list[tuple[int, str, dict[str, nn.Parameter]]]:
        return [(i, e.placeholder, v) for i, (e, v) in enumerate(zip(self.embeddings, self.vectors)) if e.train]

    def parameter_groups(self, config: TrainConfig) -> list[dict]:
        learning_rates = {e.placeholder: e.learning_rate for e in config.embeddings}
        groups = []
        for index, placeholder, vectors in self._trained():
            lr = learning_rates.get(placeholder, self.embeddings[index].learning_rate) or config.optimizer.lr
            groups.append({"params": list(vectors.values()), "lr": lr, "name": f"embedding {placeholder}"})
        return groups

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"{placeholder}.{part}", p)
                for _, placeholder, vectors in self._trained() for part, p in vectors.items()]

    def guarded_parameters(self) -> list[tuple[str, nn.Parameter]]:
        # an embedding whose placeholder no caption of the step held has a zero gradient and
        # rightly did not move: only the ones looked up are held to the first-step guard
        seen = [any(flags) for flags in zip(*(hook.seen_vectors() for hook in self.hooks))]
        return [(f"{placeholder}.{part}", p) for index, placeholder, vectors in self._trained()
                if seen[index] for part, p in vectors.items()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict[str, torch.Tensor], source: str) -> None:
        own = dict(self.named_parameters())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ConfigError([f"embeddings: {source} holds other embeddings than this run trains (missing: "
                               f"{', '.join(missing) or 'none'}; unexpected: {', '.join(unexpected) or 'none'}); "
                               f"resume with the embeddings of the backup's run"])
        for name, parameter in own.items():
            if state[name].shape != parameter.shape:
                raise ConfigError([f"embeddings: {source} has {name} as {list(state[name].shape)}, this run's is "
                                   f"{list(parameter.shape)} (vectors changed?)"])
            with torch.no_grad():
                parameter.copy_(state[name])

    # --- files -------------------------------------------------------------------------------

    def file_path(self, path: Path, index: int) -> Path:
        """Where an embedding is saved: trained alone, the first trained one at `path` (the output
        path); every other one, and all of them beside an adapter or model, next to it as
        <stem>.<placeholder>.safetensors."""
        trained = [i for i, _, _ in self._trained()]
        if self.config.method.type == self.name and index == trained[0]:
            return path
        return path.with_name(f"{path.stem}.{self.embeddings[index].file_stem}.safetensors")

    def save(self, path: Path, dtype: torch.dtype, metadata: dict[str, str]) -> list[Path]:
        keys = {part: key for part, (_attribute, key) in self.slots.items()}
        saved = []
        for index, placeholder, vectors in self._trained():
            info = {**metadata, "difftrainer.placeholder": placeholder,
                    "difftrainer.vectors": str(next(iter(vectors.values())).shape[0]),
                    "difftrainer.step": str(self.trainer.step)}
            saved.append(write_embedding_file(self.file_path(Path(path), index), vectors, keys, dtype, info))
        return saved
