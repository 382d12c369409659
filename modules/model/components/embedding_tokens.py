"""New tokens in a text encoder whose embedding table stays untouched.

diffusers' textual inversion resizes the token embedding table and trains it whole, restoring the
old rows after each step. Here the table is never resized or written: the new tokens' vectors are
their own small parameters, and hooks on the token embedding look up ids at or past the first new
id in them. The old rows stay bit-identical by construction, the optimizer holds only the new
vectors, and the text encoder's state dict (what a fine-tune saves) keeps its original shape.

The multi-vector convention is diffusers': a placeholder of N vectors is the tokens `<p>`, `<p>_1`,
..., `<p>_{N-1}`, and a prompt's `<p>` is written out as all N before tokenizing (diffusers'
pipelines with TextualInversionLoaderMixin do this in `maybe_convert_prompt`; `expand_placeholders`
does it for captions, `write_out_added_tokens` for sample prompts of pipelines that do not).
"""

from __future__ import annotations

import re

import torch
from torch import nn


def token_embedding(text_encoder: nn.Module) -> nn.Embedding:
    """The token embedding module the text encoder's forward runs. transformers 5's T5EncoderModel
    answers get_input_embeddings() with `shared`, a module of its own that only shares its weight with
    `encoder.embed_tokens`, the one the forward calls: a hook on `shared` would never fire."""
    stack = getattr(text_encoder, "encoder", None)
    embed = getattr(stack, "embed_tokens", None)
    return embed if isinstance(embed, nn.Embedding) else text_encoder.get_input_embeddings()


def placeholder_tokens(placeholder: str, vectors: int) -> list[str]:
    return [placeholder] + [f"{placeholder}_{index}" for index in range(1, vectors)]


def expand_placeholders(text: str, placeholders: dict[str, int]) -> str:
    """Each placeholder written out as its N tokens (as diffusers' maybe_convert_prompt does)."""
    for placeholder, vectors in placeholders.items():
        if vectors > 1:
            text = text.replace(placeholder, " ".join(placeholder_tokens(placeholder, vectors)))
    return text


def write_out_added_tokens(text: str, tokenizer) -> str:
    """`text` with each multi-vector placeholder the tokenizer was given (`<p>` with `<p>_1`, ...)
    written out as its tokens; a placeholder already written out is left as it is."""
    added = set(tokenizer.get_added_vocab())
    for token in sorted(added, key=len, reverse=True):
        count = 1
        while f"{token}_{count}" in added:
            count += 1
        if count > 1:
            tokens = placeholder_tokens(token, count)
            rest = re.escape(" " + " ".join(tokens[1:]))
            text = re.sub(rf"{re.escape(token)}(?:{rest})?(?!_\d)", lambda _: " ".join(tokens), text)
    return text


def add_tokens(tokenizer, tokens: list[str], where: str) -> list[int]:
    """Add `tokens` to the tokenizer; their ids (consecutive). A token the tokenizer already knows is
    refused: its old meaning would be overwritten."""
    vocabulary = tokenizer.get_vocab()
    known = [token for token in tokens if token in vocabulary]
    if known:
        raise ValueError(f"{where}: the tokenizer already has the token(s) {', '.join(known)}; choose a "
                         f"placeholder that is not a word of the vocabulary")
    tokenizer.add_tokens(tokens)
    ids = tokenizer.convert_tokens_to_ids(tokens)
    if ids != list(range(ids[0], ids[0] + len(ids))):
        raise ValueError(f"{where}: the tokenizer gave the new tokens ids {ids}, not consecutive ones")
    return ids


def init_vectors(tokenizer, table: torch.Tensor, init_text: str, vectors: int, where: str) -> torch.Tensor:
    """[vectors, dim] rows of `table` for the init text's tokens, repeated when it has fewer tokens
    than vectors (kohya's init_word). Tokens that are only a word boundary (T5's lone `▁`, byte-level
    BPE's `Ġ`) carry no meaning and are left out."""
    ids = [i for i in tokenizer(init_text, add_special_tokens=False).input_ids if tokenizer.decode([i]).strip()]
    if not ids:
        raise ValueError(f"{where}: {init_text!r} gives no tokens")
    if len(ids) > vectors:
        raise ValueError(f"{where}: {init_text!r} is {len(ids)} tokens, more than the embedding's {vectors} "
                         f"vector(s): shorten it or raise vectors")
    return table.detach()[[ids[index % len(ids)] for index in range(vectors)]].float().clone()


class AddedTokenRows:
    """Hooks on one text encoder's token embedding: ids in [first_id, first_id + rows) are looked up
    in `vectors` (the new tokens' parameters, in id order), every other id in the unchanged table.
    All vectors take part in every forward, so each gets a gradient (zero when its placeholder is
    not in the batch) rather than none."""

    def __init__(self, embedding: nn.Embedding, first_id: int, vectors: list[torch.Tensor], mark_seen: bool = True):
        # mark_seen False: the planner's pass on tensors without data (the marking selects by a mask)
        self.embedding, self.first_id, self.vectors, self.mark_seen = embedding, first_id, vectors, mark_seen
        self.rows = sum(v.shape[0] for v in vectors)
        self._ids: list[torch.Tensor] = []
        # which new rows a forward has looked up (marked on the device: no sync per forward)
        self.seen = torch.zeros(self.rows, dtype=torch.bool, device=vectors[0].device if vectors else None)
        self.handles = [embedding.register_forward_pre_hook(self._before),
                        embedding.register_forward_hook(self._after)]

    def _added(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids >= self.first_id) & (ids < self.first_id + self.rows)

    def _before(self, _module, args):
        ids = args[0]
        self._ids.append(ids)  # a stack: the lookup after the table's forward needs the real ids
        return (torch.where(self._added(ids), torch.zeros_like(ids), ids), *args[1:])

    def _after(self, _module, _args, output: torch.Tensor) -> torch.Tensor:
        # (on the rows' device: a table on the host (offload/host_tables.py) looks up ids there and
        # sends its rows to the train device, where the new vectors are)
        ids = self._ids.pop().to(output.device)
        added = self._added(ids)
        if self.mark_seen:
            self.seen[(ids[added] - self.first_id).to(self.seen.device)] = True
        table = torch.cat([v.to(device=output.device, dtype=output.dtype) for v in self.vectors])
        rows = nn.functional.embedding((ids - self.first_id).clamp(0, self.rows - 1), table)
        return torch.where(added.unsqueeze(-1), rows, output)

    def seen_vectors(self) -> list[bool]:
        """Per entry of `vectors`: whether a forward has looked up any of its rows."""
        seen, start = self.seen.tolist(), 0
        flags = []
        for vector in self.vectors:
            flags.append(any(seen[start:start + vector.shape[0]]))
            start += vector.shape[0]
        return flags

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
