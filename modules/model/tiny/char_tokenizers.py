"""Character-level tokenizers for tiny test models of families whose text encoders are not CLIP
(T5, Qwen3), written offline with the `tokenizers` library. Real models bring their own
tokenizer folders; these exist so tests and `make-tiny-model` need no download."""

from __future__ import annotations

import string
from pathlib import Path


def write_char_sentencepiece_tokenizer(folder: str | Path, max_length: int = 32) -> int:
    """A T5-style tokenizer (Metaspace pre-tokenizer, `</s>` appended, `<pad>` = 0); returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>"]
    vocab = [(t, 0.0) for t in specials] + [(c, -1.0) for c in string.printable[:95]] + [("\u2581", -1.0)]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                                      unk_token="<unk>", model_max_length=max_length)
    wrapped.save_pretrained(str(folder))
    return len(vocab)


def write_char_bpe_tokenizer(folder: str | Path, max_length: int = 64, chat_template: str | None = None) -> int:
    """A Qwen-style byte-level BPE tokenizer with no merges (each byte its own token), with
    `<|endoftext|>` as pad and the chat markers `<|im_start|>`/`<|im_end|>`; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: index for index, token in enumerate(sorted(alphabet))}
    for token in specials:
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>",
                                      eos_token="<|im_end|>", model_max_length=max_length)
    if chat_template:
        wrapped.chat_template = chat_template
    wrapped.save_pretrained(str(folder))
    return len(vocab)
