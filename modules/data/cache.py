"""A content-addressed tensor cache on disk: one safetensors file per key.

Keys hash everything that changes the cached tensor (image bytes, crop size, caption, the
encoder's weights and dtype), so a change makes a new key and a stale entry is never read. The
same keys make building resumable: an entry written before an interrupt is found and reused.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from modules.errors import UserError
from modules.util.atomic import write_errors

CACHE_FORMAT = "1"  # bump when what is cached or how it is computed changes


def cache_key(*facts: object) -> str:
    text = "\x1f".join(str(f) for f in (CACHE_FORMAT, *facts))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


class CacheEntryGone(UserError):
    """An entry found while the caches were built is missing or damaged when a batch reads it."""


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

    def names(self, key: str) -> set[str] | None:
        """The tensor names an entry holds, from its header alone (no tensor is read); None when
        the entry is absent or unreadable (a truncated file fails here: safetensors checks that
        the header's offsets cover the file)."""
        layout = self.layout(key)
        return None if layout is None else set(layout)

    def layout(self, key: str) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        """Each tensor's (safetensors dtype name, shape) in an entry, from its header alone; None
        as for names()."""
        path = self.path(key)
        try:
            with safe_open(str(path), framework="pt") as opened:
                slices = {name: opened.get_slice(name) for name in opened.keys()}
                layout = {name: (part.get_dtype(), tuple(part.get_shape())) for name, part in slices.items()}
        except (SafetensorError, OSError):
            self.misses += 1
            return None
        self.hits += 1
        return layout

    def tensors(self, key: str, names: set[str]) -> dict[str, torch.Tensor] | None:
        """Only the named tensors of an entry (a small one beside large ones: the rest is not read);
        None when the entry is absent or unreadable, or lacks one of them."""
        try:
            with safe_open(str(self.path(key)), framework="pt") as opened:
                return {name: opened.get_tensor(name) for name in names}
        except (SafetensorError, OSError):
            return None

    def count_stale(self) -> None:
        """An entry found (and counted as a hit) that is not what its key must hold: a miss, rebuilt."""
        self.hits -= 1
        self.misses += 1

    def read(self, key: str) -> dict[str, torch.Tensor]:
        """The entry's tensors, for an entry known to exist (a training batch needs it)."""
        path = self.path(key)
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as error:
            raise CacheEntryGone(f"cache entry {path} was found when the caches were built but cannot be read "
                                 f"now ({error}); was the cache folder changed during the run? Start the run "
                                 "again to rebuild what is missing") from None

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        target = self.path(key)
        # a temp name renamed over the target, as every write here, but without atomic_path's fsync
        # (a disk flush per image): an entry a power loss leaves empty or torn is unreadable, so it
        # is a miss and is rebuilt
        temp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with write_errors(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                save_file(cpu, str(temp))
                os.replace(temp, target)
            except BaseException:
                temp.unlink(missing_ok=True)
                raise
