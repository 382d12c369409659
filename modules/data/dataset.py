"""The training set: scanned concepts, bucketed, with latents (and, when the text encoder is
frozen, text conditioning) encoded once into the disk cache and then served from memory.

Epoch order is a pure function of (seed, epoch), so a resumed run sees the same batches as an
uninterrupted one from the same position.
"""

from __future__ import annotations

import hashlib
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from tqdm import tqdm

from modules.config.train_config import CaptionConfig
from modules.data.augment import color_jitter, crop_position
from modules.data.buckets import bucket_for
from modules.data.cache import TensorCache, cache_key
from modules.data.captions import caption_rng, fixed_caption, varied_caption
from modules.data.concepts import ConceptItem, DataError, check_concepts, scan_concept
from modules.data.images import crop_origin, image_size, load_cropped
from modules.data.masks import latent_mask, load_mask, mask_path
from modules.data.masks import loss_weights as mask_loss_weights

if TYPE_CHECKING:
    from modules.config.train_config import TrainConfig
    from modules.model.base import ModelFamily

ENCODE_BATCH = 4
FLIPPED = ":flipped"  # suffix of a latent key that names the mirrored image's latents


@dataclass
class Entry:
    item: ConceptItem
    bucket: tuple[int, int]
    latent_key: str
    text_key: str | None
    repeats: int
    loss_weight: float = 1.0
    captions: CaptionConfig | None = None  # varying caption options (None: the caption as scanned)
    mask: Path | None = None  # the loss mask file, when the concept trains with masked_loss
    unmasked_weight: float = 1.0
    samples_per_epoch: int | None = None
    flip: bool = False  # a mirrored version is cached too, and drawn half of the time
    original_size: tuple[int, int] | None = None  # (width, height) of the image file, EXIF applied


@dataclass
class Batch:
    latents: torch.Tensor
    text: dict[str, torch.Tensor] | None  # cached conditioning, or None when the text encoder trains
    captions: list[str]
    loss_weights: torch.Tensor | None = None  # per sample (its concept's loss_weight); None: all 1
    masks: torch.Tensor | None = None  # (B, 1, h, w) per-pixel loss weights on the latent grid; None: all 1
    # (B, 4): original height, original width, crop top, crop left (SDXL's size conditioning)
    image_info: torch.Tensor | None = None


def _image_info(entry: Entry, position: tuple[float, float]) -> list[float]:
    """Original height and width, crop top and left (the bucket and no crop when the size is unknown)."""
    if entry.original_size is None:
        return [entry.bucket[1], entry.bucket[0], 0, 0]
    return [entry.original_size[1], entry.original_size[0], *crop_origin(entry.original_size, *entry.bucket, position)]


@dataclass
class FreshLatents:
    """Latents encoded per batch, for pixel augmentations that differ each time an image trains."""

    family: ModelFamily
    crop_jitter: bool
    color_jitter: float

    @torch.no_grad()
    def encode(self, entries: list[Entry], flipped: list[bool], rngs: list, device: torch.device):
        pixels, masks, positions = [], [], []
        for entry, flip, rng in zip(entries, flipped, rngs):
            width, height = entry.bucket
            position = crop_position(rng, self.crop_jitter)
            positions.append(position)
            image = load_cropped(entry.item.image, width, height, position)
            mask = load_mask(entry.mask, width, height, position) if entry.mask is not None else None
            if flip:
                image = image.flip(-1)
                mask = mask.flip(-1) if mask is not None else None
            pixels.append(color_jitter(image, self.color_jitter, rng))
            masks.append(mask)
        latents = self.family.encode_images(torch.stack(pixels).to(device)).float()
        grid = latents.shape[-2:]
        return latents, [latent_mask(m, *grid) if m is not None else None for m in masks], positions


class TrainDataset:
    def __init__(self, entries: list[Entry], latents: dict[str, torch.Tensor],
                 texts: dict[str, dict[str, torch.Tensor]], batch_size: int, seed: int,
                 masks: dict[str, torch.Tensor] | None = None, fresh: FreshLatents | None = None):
        self.entries = entries
        self.fresh = fresh  # set when latents are encoded per batch (pixel augmentations), not cached
        self.latents = latents  # latent key -> latents; latent key + FLIPPED -> the mirrored image's
        self.masks = masks or {}  # the same keys, for masked entries
        self.texts = texts
        self.batch_size = batch_size
        self.seed = seed
        self.cache_stats: dict[str, tuple[int, int]] = {}  # cache name -> (hits, misses)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Indices into entries, grouped so each batch shares one bucket; repeats expanded, and
        concepts with samples_per_epoch contributing exactly that many (cycling through a
        per-epoch shuffle of their images)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        expanded = [i for i, entry in enumerate(self.entries) if entry.samples_per_epoch is None
                    for _ in range(entry.repeats)]
        by_concept: dict[int, list[int]] = defaultdict(list)
        for i, entry in enumerate(self.entries):
            if entry.samples_per_epoch is not None:
                by_concept[entry.item.concept].append(i)
        for concept, members in sorted(by_concept.items()):
            # an endless sequence of shuffled rounds through the concept's images; epoch e takes
            # the next `wanted` of it, so every image comes once before any comes twice
            wanted, count = self.entries[members[0]].samples_per_epoch, len(members)
            start, end = epoch * wanted, (epoch + 1) * wanted
            order = []
            for round_index in range(start // count, (end - 1) // count + 1):
                shuffle = torch.Generator().manual_seed((self.seed * 1_000_003 + concept) * 7_919 + round_index)
                order += [members[j] for j in torch.randperm(count, generator=shuffle).tolist()]
            offset = (start // count) * count
            expanded += order[start - offset:end - offset]
        by_bucket: dict[tuple[int, int], list[int]] = defaultdict(list)
        for j in torch.randperm(len(expanded), generator=generator).tolist():
            by_bucket[self.entries[expanded[j]].bucket].append(expanded[j])
        batches = [
            members[start:start + self.batch_size]
            for _, members in sorted(by_bucket.items())
            for start in range(0, len(members), self.batch_size)
        ]
        return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]

    def collate(self, indices: list[int], device: torch.device, epoch: int = 0, batch_index: int = 0) -> Batch:
        """The batch's tensors on `device`; varying caption options drawn for (epoch, batch_index)."""
        entries = [self.entries[i] for i in indices]
        rngs = [caption_rng(self.seed, epoch, batch_index, position) for position in range(len(entries))]
        # each sample's stream draws its flip first, then (fresh latents) its crop and colour, then its caption
        flipped = [e.flip and rng.random() < 0.5 for e, rng in zip(entries, rngs)]
        if self.fresh is None:
            latent_keys = [e.latent_key + FLIPPED if flip else e.latent_key for e, flip in zip(entries, flipped)]
            latents = torch.stack([self.latents[k] for k in latent_keys]).to(device, non_blocking=True)
            sample_masks = [self.masks.get(k) for k in latent_keys]
            positions = [(0.5, 0.5)] * len(entries)
        else:
            latents, sample_masks, positions = self.fresh.encode(entries, flipped, rngs, device)
        image_info = torch.tensor([_image_info(e, p) for e, p in zip(entries, positions)], dtype=torch.float32,
                                  device=device)
        text = None
        if entries[0].text_key is not None:
            keys = self.texts[entries[0].text_key].keys()
            text = {k: torch.stack([self.texts[e.text_key][k] for e in entries]).to(device, non_blocking=True) for k in keys}
        weights = [e.loss_weight for e in entries]
        loss_weights = None if all(w == 1.0 for w in weights) else torch.tensor(weights, device=device)
        captions = [varied_caption(e.item.caption, e.captions, rng) if e.captions is not None else e.item.caption
                    for e, rng in zip(entries, rngs)]
        masks = None
        if any(m is not None for m in sample_masks):
            grid = latents.shape[-2:]
            raw = torch.stack([m if m is not None else torch.ones(1, *grid) for m in sample_masks]).to(device)
            floor = torch.tensor([e.unmasked_weight if m is not None else 1.0 for e, m in zip(entries, sample_masks)])
            masks = mask_loss_weights(raw, floor.to(device))
        return Batch(latents, text, captions, loss_weights, masks, image_info)


def _file_hash(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def prepare_dataset(config: TrainConfig, family: ModelFamily, device: torch.device, cache_dir: Path,
                    warn: Callable[[str], None], cache_text: bool, validation: bool = False) -> TrainDataset:
    """Scan, bucket, and fill the caches, for the training concepts (or, with `validation`, the
    validation concepts). Unreadable images are skipped with a warning naming the file; a concept
    left without any usable image is an error naming its folder."""
    check_concepts(config.concepts)
    concepts = [(i, c) for i, c in enumerate(config.concepts) if c.enabled and c.validation == validation]
    latent_cache = TensorCache(cache_dir / "latents")
    text_cache = TensorCache(cache_dir / "text")
    image_identity = family.fingerprint(*family.image_parts)
    text_identity = family.fingerprint(*family.text_parts) if cache_text else None
    quantum = family.bucket_quantum

    entries: list[Entry] = []
    for index, concept in concepts:
        usable, unmasked = 0, 0
        for item in scan_concept(index, concept, warn):
            item = ConceptItem(item.image, fixed_caption(item.caption, concept.captions), item.concept)
            mask = mask_path(item.image) if concept.masked_loss else None
            unmasked += concept.masked_loss and mask is None
            try:
                size = image_size(item.image)
                content = _file_hash(item.image) + (":" + _file_hash(mask) if mask else "")
            except Exception as error:  # PIL raises many kinds for a broken file
                warn(f"skipping unreadable image {item.image}: {error}")
                continue
            for resolution in config.data.resolutions:
                bucket = bucket_for(*size, resolution, quantum, config.data.aspect_buckets)
                latent_key = cache_key("latent", content, bucket, image_identity, "center-crop",
                                       "mask" if mask else "", "flip" if config.data.flip else "")
                text_key = cache_key("text", item.caption, text_identity) if cache_text else None
                entries.append(Entry(item, bucket, latent_key, text_key, concept.repeats, concept.loss_weight,
                                     concept.captions if concept.captions.varies else None, mask,
                                     concept.unmasked_weight if mask else 1.0, concept.samples_per_epoch,
                                     config.data.flip, size))
            usable += 1
        if unmasked:
            warn(f"concepts[{index}].masked_loss: {unmasked} image(s) in {concept.path} have no -masklabel "
                 "file; they train with full weight everywhere")
        if usable == 0:
            raise DataError(f"concepts[{index}].path: no usable image in {concept.path}")

    fresh = None
    if config.data.cache_latents:
        latents, masks = _fill_latents(entries, family, device, latent_cache, warn)
        entries = [e for e in entries if e.latent_key in latents]
    else:
        latents, masks = {}, {}
        fresh = FreshLatents(family, config.data.crop_jitter, config.data.color_jitter)
    for index, concept in concepts:
        if not any(e.item.concept == index for e in entries):
            raise DataError(f"concepts[{index}].path: no usable image in {concept.path}")
    texts = _fill_texts(entries, family, device, text_cache) if cache_text else {}
    dataset = TrainDataset(entries, latents, texts, config.schedule.batch_size, config.seed, masks, fresh)
    dataset.cache_stats = {"latents": (latent_cache.hits, latent_cache.misses),
                           "text": (text_cache.hits, text_cache.misses)}
    return dataset


def caching_progress(total: int, what: str, unit: str) -> tqdm:
    """A tqdm bar on stderr while the encoders run (minutes for a big data set on a slow machine);
    tqdm turns it off where stderr is no terminal (the GUI and log files get the summary line)."""
    return tqdm(total=total, desc=what, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
                disable=None if total else True)


@torch.no_grad()
def _fill_latents(entries, family, device, cache, warn) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Latents per latent key and, for masked entries, their masks on the latent grid."""
    latents: dict[str, torch.Tensor] = {}
    masks: dict[str, torch.Tensor] = {}
    todo: dict[tuple[int, int], list[Entry]] = defaultdict(list)
    pending: set[str] = set()
    for entry in entries:
        if entry.latent_key in latents or entry.latent_key in pending:
            continue
        cached = cache.get(entry.latent_key)
        needed = ["latents"] + (["mask"] if entry.mask else []) + (["latents_flipped"] if entry.flip else [])
        if cached is not None and all(name in cached for name in needed):
            for name, value in cached.items():
                target = masks if name.startswith("mask") else latents
                target[entry.latent_key + (FLIPPED if name.endswith("_flipped") else "")] = value
        else:
            todo[entry.bucket].append(entry)
            pending.add(entry.latent_key)
    bar = caching_progress(sum(len(group) for group in todo.values()), "encoding latents", "image")
    for (width, height), group in todo.items():
        pixels, ready = [], []
        for entry in group:
            try:
                pixels.append(load_cropped(entry.item.image, width, height))
                ready.append(entry)
            except Exception as error:
                warn(f"skipping unreadable image {entry.item.image}: {error}")
                bar.update(1)
        for start in range(0, len(pixels), ENCODE_BATCH):
            chunk, chunk_entries = pixels[start:start + ENCODE_BATCH], ready[start:start + ENCODE_BATCH]
            encoded = family.encode_images(torch.stack(chunk).to(device)).float().cpu()
            flipped_pixels = [p.flip(-1) for p, e in zip(chunk, chunk_entries) if e.flip]
            flipped = (iter(family.encode_images(torch.stack(flipped_pixels).to(device)).float().cpu())
                       if flipped_pixels else iter(()))
            for entry, latent in zip(chunk_entries, encoded):
                key = entry.latent_key
                stored = {"latents": latent.clone()}
                if entry.flip:  # the mirrored image encoded, not the latent mirrored: the VAE is not symmetric
                    stored["latents_flipped"] = next(flipped).clone()
                if entry.mask is not None:
                    stored["mask"] = latent_mask(load_mask(entry.mask, width, height), *latent.shape[-2:])
                    if entry.flip:
                        stored["mask_flipped"] = stored["mask"].flip(-1)
                for name, value in stored.items():
                    target = masks if name.startswith("mask") else latents
                    target[key + (FLIPPED if name.endswith("_flipped") else "")] = value
                cache.put(key, stored)
            bar.update(len(chunk_entries))
    bar.close()
    return latents, masks


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
    bar = caching_progress(len(keys), "encoding captions", "caption")
    for start in range(0, len(keys), ENCODE_BATCH):
        chunk = keys[start:start + ENCODE_BATCH]
        encoded = family.encode_text(family.tokenize([todo[k] for k in chunk]))
        for row, key in enumerate(chunk):
            texts[key] = {name: t[row].float().cpu().clone() for name, t in encoded.items()}
            cache.put(key, texts[key])
        bar.update(len(chunk))
    bar.close()
    return texts
