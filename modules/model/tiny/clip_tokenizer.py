"""A character-level CLIP BPE tokenizer written offline, for tiny test models.

CLIP's tokenizer is byte-level BPE: every byte maps to a printable unicode character, words end
in "</w>", and merges join frequent pairs. With no merges every character is its own token, so
a vocabulary of the 256 byte characters (plain and word-final) plus the two special tokens
tokenizes any text. Real models bring their own tokenizer folder; this exists so tests and the
demo need no download.
"""

from __future__ import annotations

import json
from pathlib import Path


def byte_characters() -> list[str]:
    """The 256 printable characters byte-level BPE uses for bytes 0..255, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    extra = 0
    characters = []
    for byte in range(256):
        if byte in printable:
            characters.append(chr(byte))
        else:
            characters.append(chr(256 + extra))  # bytes without a printable glyph get one above 255
            extra += 1
    return characters


def write_char_clip_tokenizer(folder: str | Path, max_length: int = 77) -> int:
    """Write vocab.json, merges.txt and the tokenizer configs; return the vocabulary size."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokens = byte_characters() + [c + "</w>" for c in byte_characters()] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: index for index, token in enumerate(tokens)}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "CLIPTokenizer",
                "model_max_length": max_length,
                "bos_token": "<|startoftext|>",
                "eos_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "do_lower_case": True,
            }
        ),
        encoding="utf-8",
    )
    (folder / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": "<|startoftext|>",
                "eos_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
            }
        ),
        encoding="utf-8",
    )
    return len(vocab)
