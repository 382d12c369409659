"""A content-addressed tensor cache on disk: one safetensors file per key.

Keys hash everything that changes the cached tensor (image bytes, crop size, caption, the
encoder's weights and dtype), so a change makes a new key and a stale entry is never read.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from modules.saving.atomic import write_with

CACHE_FORMAT = "1"  # bump when what is cached or how it is computed changes


def cache_key(*facts: object) -> str:
    text = "\x1f".join(str(f) for f in (CACHE_FORMAT, *facts))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


class TensorCache:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.hits = 0
        self.misses = 0

    def path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.safetensors"

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        path = self.path(key)
        if not path.is_file():
            self.misses += 1
            return None
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError):
            self.misses += 1  # unreadable entry: rebuilt and overwritten
            return None
        self.hits += 1
        return tensors

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        write_with(self.path(key), lambda temp: save_file(cpu, str(temp)))
