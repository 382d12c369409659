"""The training set: scanned concepts, bucketed, with latents (and, when the text encoder is
frozen, text conditioning) encoded once into the disk cache and then served from memory.

Epoch order is a pure function of (seed, epoch), so a resumed run sees the same batches as an
uninterrupted one from the same position.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from modules.data.buckets import bucket_for
from modules.data.cache import TensorCache, cache_key
from modules.data.concepts import ConceptItem, DataError, check_concepts, scan_concept
from modules.data.images import image_size, load_cropped

if TYPE_CHECKING:
    from modules.config.train_config import TrainConfig
    from modules.model.base import ModelFamily

ENCODE_BATCH = 4


@dataclass
class Entry:
    item: ConceptItem
    bucket: tuple[int, int]
    latent_key: str
    text_key: str | None
    repeats: int


@dataclass
class Batch:
    latents: torch.Tensor
    text: dict[str, torch.Tensor] | None  # cached conditioning, or None when the text encoder trains
    captions: list[str]


class TrainDataset:
    def __init__(self, entries: list[Entry], latents: dict[str, torch.Tensor],
                 texts: dict[str, dict[str, torch.Tensor]], batch_size: int, seed: int):
        self.entries = entries
        self.latents = latents
        self.texts = texts
        self.batch_size = batch_size
        self.seed = seed
        self.cache_stats: dict[str, tuple[int, int]] = {}  # cache name -> (hits, misses)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Indices into entries, grouped so each batch shares one bucket; repeats expanded."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        expanded = [i for i, entry in enumerate(self.entries) for _ in range(entry.repeats)]
        by_bucket: dict[tuple[int, int], list[int]] = defaultdict(list)
        for j in torch.randperm(len(expanded), generator=generator).tolist():
            by_bucket[self.entries[expanded[j]].bucket].append(expanded[j])
        batches = [
            members[start:start + self.batch_size]
            for _, members in sorted(by_bucket.items())
            for start in range(0, len(members), self.batch_size)
        ]
        return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]

    def collate(self, indices: list[int], device: torch.device) -> Batch:
        entries = [self.entries[i] for i in indices]
        latents = torch.stack([self.latents[e.latent_key] for e in entries]).to(device, non_blocking=True)
        text = None
        if entries[0].text_key is not None:
            keys = self.texts[entries[0].text_key].keys()
            text = {k: torch.stack([self.texts[e.text_key][k] for e in entries]).to(device, non_blocking=True) for k in keys}
        return Batch(latents, text, [e.item.caption for e in entries])


def _file_hash(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def prepare_dataset(config: TrainConfig, family: ModelFamily, device: torch.device, cache_dir: Path,
                    warn: Callable[[str], None], cache_text: bool) -> TrainDataset:
    """Scan, bucket, and fill the caches. Unreadable images are skipped with a warning naming
    the file; a concept left without any usable image is an error naming its folder."""
    check_concepts(config.concepts)
    concepts = [(i, c) for i, c in enumerate(config.concepts) if c.enabled]
    latent_cache = TensorCache(cache_dir / "latents")
    text_cache = TensorCache(cache_dir / "text")
    image_identity = family.fingerprint(*family.image_parts)
    text_identity = family.fingerprint(*family.text_parts) if cache_text else None
    resolution, quantum = config.data.resolution, family.bucket_quantum

    entries: list[Entry] = []
    for index, concept in concepts:
        usable = 0
        for item in scan_concept(index, concept, warn):
            try:
                bucket = bucket_for(*image_size(item.image), resolution, quantum, config.data.aspect_buckets)
                content = _file_hash(item.image)
            except Exception as error:  # PIL raises many kinds for a broken file
                warn(f"skipping unreadable image {item.image}: {error}")
                continue
            latent_key = cache_key("latent", content, bucket, image_identity, "center-crop")
            text_key = cache_key("text", item.caption, text_identity) if cache_text else None
            entries.append(Entry(item, bucket, latent_key, text_key, concept.repeats))
            usable += 1
        if usable == 0:
            raise DataError(f"concepts[{index}].path: no usable image in {concept.path}")

    latents = _fill_latents(entries, family, device, latent_cache, warn)
    entries = [e for e in entries if e.latent_key in latents]
    for index, concept in concepts:
        if not any(e.item.concept == index for e in entries):
            raise DataError(f"concepts[{index}].path: no usable image in {concept.path}")
    texts = _fill_texts(entries, family, device, text_cache) if cache_text else {}
    dataset = TrainDataset(entries, latents, texts, config.schedule.batch_size, config.seed)
    dataset.cache_stats = {"latents": (latent_cache.hits, latent_cache.misses),
                           "text": (text_cache.hits, text_cache.misses)}
    return dataset


@torch.no_grad()
def _fill_latents(entries, family, device, cache, warn) -> dict[str, torch.Tensor]:
    latents: dict[str, torch.Tensor] = {}
    todo: dict[tuple[int, int], list[Entry]] = defaultdict(list)
    for entry in entries:
        if entry.latent_key in latents:
            continue
        cached = cache.get(entry.latent_key)
        if cached is not None and "latents" in cached:
            latents[entry.latent_key] = cached["latents"]
        else:
            todo[entry.bucket].append(entry)
    for (width, height), group in todo.items():
        pixels, keys = [], []
        for entry in group:
            try:
                pixels.append(load_cropped(entry.item.image, width, height))
                keys.append(entry.latent_key)
            except Exception as error:
                warn(f"skipping unreadable image {entry.item.image}: {error}")
        for start in range(0, len(pixels), ENCODE_BATCH):
            batch = torch.stack(pixels[start:start + ENCODE_BATCH]).to(device)
            encoded = family.encode_images(batch).float().cpu()
            for key, latent in zip(keys[start:start + ENCODE_BATCH], encoded):
                latents[key] = latent.clone()
                cache.put(key, {"latents": latents[key]})
    return latents


@torch.no_grad()
def _fill_texts(entries, family, device, cache) -> dict[str, dict[str, torch.Tensor]]:
    texts: dict[str, dict[str, torch.Tensor]] = {}
    todo: dict[str, str] = {}
    for entry in entries:
        if entry.text_key in texts or entry.text_key in todo:
            continue
        cached = cache.get(entry.text_key)
        if cached:  # an empty entry is as good as none
            texts[entry.text_key] = cached
        else:
            todo[entry.text_key] = entry.item.caption
    keys = list(todo)
    for start in range(0, len(keys), ENCODE_BATCH):
        chunk = keys[start:start + ENCODE_BATCH]
        encoded = family.encode_text(family.tokenize([todo[k] for k in chunk]))
        for row, key in enumerate(chunk):
            texts[key] = {name: t[row].float().cpu().clone() for name, t in encoded.items()}
            cache.put(key, texts[key])
    return texts
