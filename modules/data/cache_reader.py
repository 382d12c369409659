"""Cached latents and text conditioning read from the disk cache as batches need them.

A training set's entries are not held in memory: each batch reads its samples' cache files, and
the most recently used files stay in a bounded in-memory LRU (data.cache_memory_mb), so RSS stays
the same whatever the number of images. Whole files are kept (a latent file also holds its
flipped latents and masks), counted by their tensors' bytes.

Thread-safe: the background loader reads while the main thread may collate a validation batch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping

import torch

from modules.data.cache import TensorCache


class CacheReader:
    """Cache files by (folder, key), the most recently used kept up to `budget_bytes`."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._held: OrderedDict[tuple[str, str], tuple[dict[str, torch.Tensor], int]] = OrderedDict()
        self._lock = threading.Lock()
        self.held_bytes = 0
        self.peak_held_bytes = 0  # the most the LRU ever held (tests check it stays within the budget)
        self.reads = 0  # files read from disk

    def entry(self, cache: TensorCache, key: str) -> dict[str, torch.Tensor]:
        slot = (str(cache.folder), key)
        with self._lock:
            held = self._held.get(slot)
            if held is not None:
                self._held.move_to_end(slot)
                return held[0]
        tensors = cache.read(key)  # outside the lock: a slow read does not hold up other readers
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._lock:
            self.reads += 1
            if size > self.budget_bytes or slot in self._held:  # too big to keep, or another thread kept it
                return tensors
            while self._held and self.held_bytes + size > self.budget_bytes:
                _, (_, evicted) = self._held.popitem(last=False)
                self.held_bytes -= evicted
            self._held[slot] = (tensors, size)
            self.held_bytes += size
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        return tensors

    def __len__(self) -> int:
        return len(self._held)


class CachedTensors(Mapping):
    """A read-only mapping over cache entries, read lazily through a CacheReader: each served key
    names (cache key, tensor name) — or (cache key, None) for the entry's whole dict of tensors."""

    def __init__(self, reader: CacheReader, cache: TensorCache, index: dict[str, tuple[str, str | None]],
                 finish: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None):
        self.reader = reader
        self.cache = cache
        self.index = index
        self.finish = finish  # what a whole entry's dict goes through when served (the LRU holds it as stored)

    def __getitem__(self, key: str):
        cache_key, name = self.index[key]
        tensors = self.reader.entry(self.cache, cache_key)
        if name is not None:
            return tensors[name]
        return dict(tensors) if self.finish is None else self.finish(dict(tensors))

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)
