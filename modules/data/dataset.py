"""The training set: scanned concepts, bucketed, with latents (and, when the text encoder is
frozen, text conditioning) encoded once into the disk cache and read back from it as batches need
them (cache_reader.py: a bounded LRU in memory, so RAM does not grow with the data set).

A batch is built in two halves: `assemble` reads and stacks on the CPU (the background loader runs
it on its thread, prefetch.py), `finish` puts it on the device (and encodes fresh latents there).
Epoch order, and every random draw of a batch, is a pure function of (seed, epoch, batch index,
position), so a resumed run sees the same batches as an uninterrupted one from the same position,
and a batch is the same whichever thread assembles it and when.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from modules.config.train_config import CaptionConfig
from modules.data.augment import color_jitter, crop_position
from modules.data.buckets import bucket_for
from modules.data.cache import TensorCache, cache_key
from modules.data.cache_build import PIXEL_CONDITIONING, fill_latents, fill_texts
from modules.data.cache_reader import CachedTensors, CacheReader
from modules.data.captions import caption_rng, fixed_caption, varied_caption
from modules.data.data_notes import caption_notes, duplicate_notes, one_frame_notes, resolution_notes, upscale_notes
from modules.data.concepts import ConceptItem, DataError, check_concepts, scan_concept
from modules.data.epoch_size import check_epoch_size
from modules.data.pairs import (attach_controls, check_controls, drop_unready, fresh_controls, scan_items,
                                text_controls)
from modules.data.images import crop_origin, image_size
from modules.data.masks import latent_mask, load_mask, mask_path
from modules.data.masks import loss_weights as mask_loss_weights
from modules.data.shares import batch_share
from modules.data.text_padding import padded, stored_text_identity
from modules.data.video import (ClipWindow, clip_windows, content_hash, frame_count_problem, is_video_concept,
                                load_entry_pixels, probe)
from modules.data.video import scan_options as video_scan_options
from modules.util.stopping import StopCheck

if TYPE_CHECKING:
    from modules.config.train_config import TrainConfig
    from modules.model.base import ModelFamily

FLIPPED = ":flipped"  # suffix of a latent key that names the mirrored image's latents
MB = 1024 * 1024


def caches_text(config: TrainConfig, family: ModelFamily) -> bool:
    """Text conditioning can be cached only while no text encoder trains, no embedding changes what
    a caption encodes to, and every caption is fixed (varying caption options encode each drawn
    caption as it is trained)."""
    return (not any(config.model.parts[p].train for p in family.text_parts) and not config.embeddings
            and not any(c.captions.varies for c in config.concepts if c.enabled))


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
    clip: ClipWindow | None = None  # a video concept's window of frames (modules/data/video.py); None: an image
    control_keys: tuple[str, ...] = ()  # latent keys of its control images (pairs.py), mirrored with it
    # the text key of its mirrored draw, for a family whose text sees the (mirrored) controls (pairs.py)
    flipped_text_key: str | None = None

    @property
    def group(self) -> tuple[tuple[int, int], int]:
        """What a batch shares: the bucket and the frame count (width x height x frames)."""
        return self.bucket, self.clip.frames if self.clip is not None else 1


@dataclass
class Batch:
    latents: torch.Tensor
    text: dict[str, torch.Tensor] | None  # cached conditioning, or None when the text encoder trains
    captions: list[str]
    loss_weights: torch.Tensor | None = None  # per sample (its concept's loss_weight); None: all 1
    masks: torch.Tensor | None = None  # (B, 1, h, w) per-pixel loss weights on the latent grid; None: all 1
    # (B, 4): original height, original width, crop top, crop left (SDXL's size conditioning)
    image_info: torch.Tensor | None = None
    controls: torch.Tensor | None = None  # (B, N, C, h, w) latents of each sample's control images; None: none
    # what the family draws from each sample's own pixels (ModelFamily.pixel_conditioning); None: nothing
    pixel_conditioning: dict[str, torch.Tensor] | None = None
    # per sample, its control images as a text encoder that sees them is shown them (PIL, pairs.text_controls),
    # for the text encoded in the step; None: the text is cached, or the family's text does not see them
    text_controls: list[list] | None = None


def _image_info(entry: Entry, position: tuple[float, float]) -> list[float]:
    """Original height and width, crop top and left (the bucket and no crop when the size is unknown)."""
    if entry.original_size is None:
        return [entry.bucket[1], entry.bucket[0], 0, 0]
    return [entry.original_size[1], entry.original_size[0], *crop_origin(entry.original_size, *entry.bucket, position)]


@dataclass
class FreshLatents:
    """Latents encoded per batch, for pixel augmentations that differ each time an image trains:
    `load` (any thread) crops, mirrors and jitters the pixels; `encode` (the device's thread) runs the VAE."""

    family: ModelFamily
    crop_jitter: bool
    color_jitter: float

    def load(self, entries: list[Entry], flipped: list[bool], rngs: list):
        pixels, masks, positions, controls = [], [], [], []
        for entry, flip, rng in zip(entries, flipped, rngs):
            width, height = entry.bucket
            position = crop_position(rng, self.crop_jitter)
            positions.append(position)
            image = load_entry_pixels(entry, width, height, position)
            mask = load_mask(entry.mask, width, height, position) if entry.mask is not None else None
            if flip:
                image = image.flip(-1)
                mask = mask.flip(-1) if mask is not None else None
            state = rng.getstate()  # the controls replay the target's colour draws
            pixels.append(color_jitter(image, self.color_jitter, rng))
            masks.append(mask)
            controls.append(fresh_controls(entry.item.controls, width, height, position, flip, self.color_jitter,
                                           rng, state))
        stacked = torch.stack(controls) if controls[0] is not None else None
        return torch.stack(pixels), masks, positions, stacked

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor, masks: list, device: torch.device):
        """Latents, masks on their grid, and the family's pixel conditioning (None: it draws none)."""
        pixels = pixels.to(device, non_blocking=True)
        latents = self.family.encode_images(pixels).float()
        conditioning = None
        if self.family.pixel_conditioning:
            conditioning = {name: t.float() for name, t in self.family.encode_pixel_conditioning(pixels).items()}
        grid = latents.shape[-2:]
        return latents, [latent_mask(m, *grid) if m is not None else None for m in masks], conditioning

    @torch.no_grad()
    def encode_controls(self, controls: torch.Tensor, device: torch.device) -> torch.Tensor:
        """(B, N, 3, H, W) control pixels -> (B, N, C, h, w) latents."""
        b, n = controls.shape[:2]
        latents = self.family.encode_images(controls.flatten(0, 1).to(device, non_blocking=True)).float()
        return latents.unflatten(0, (b, n))


@dataclass
class HostBatch:
    """A batch assembled on the CPU (in pinned memory when it goes to a CUDA device)."""

    latents: torch.Tensor | None  # cached latents; None: `pixels` are encoded on the device
    pixels: torch.Tensor | None
    masks: list  # per sample: a mask (on the latent grid when cached, the pixel grid when fresh) or None
    image_info: torch.Tensor
    text: dict[str, torch.Tensor] | None
    captions: list[str]
    loss_weights: list[float]
    unmasked_weights: list[float]
    controls: torch.Tensor | None = None
    pixel_conditioning: dict[str, torch.Tensor] | None = None  # cached; fresh latents draw it on the device
    text_controls: list[list] | None = None  # (Batch.text_controls)


def _pinned(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    return tensor.pin_memory() if pin else tensor


class TrainDataset:
    def __init__(self, entries: list[Entry], latents: Mapping[str, torch.Tensor],
                 texts: Mapping[str, dict[str, torch.Tensor]], batch_size: int, seed: int,
                 masks: Mapping[str, torch.Tensor] | None = None, fresh: FreshLatents | None = None,
                 reader: CacheReader | None = None, pixel_conditioning: Mapping[str, Mapping] | None = None,
                 text_sees_controls: bool = False):
        self.entries = entries
        # the family's text encoder sees the control images: an uncached text is encoded with them
        self.text_sees_controls = text_sees_controls
        self.fresh = fresh  # set when latents are encoded per batch (pixel augmentations), not cached
        self.latents = latents  # latent key -> latents; latent key + FLIPPED -> the mirrored image's
        self.masks = masks or {}  # the same keys, for masked entries
        # the family's pixel conditioning by name, each under the same keys as the latents
        self.pixel_conditioning = pixel_conditioning or {}
        self.texts = texts
        self.reader = reader  # the LRU the cached mappings read through (None: plain dicts)
        self.batch_size = batch_size
        self.seed = seed
        self.cache_stats: dict[str, tuple[int, int]] = {}  # cache name -> (hits, misses)
        self.rank, self.world = 0, 1  # this process's place among the data-parallel ones (split_among)

    def split_among(self, rank: int, world: int) -> None:
        """Data parallel: epoch batches become global batches (batch_size x world), of which this
        dataset assembles rank's share (shares.py)."""
        self.batch_size *= world
        self.rank, self.world = rank, world

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
                # (wrapped into 63 bits: the seed's whole range must stay a valid torch seed)
                derived = ((self.seed * 1_000_003 + concept) * 7_919 + round_index) % 2**63
                shuffle = torch.Generator().manual_seed(derived)
                order += [members[j] for j in torch.randperm(count, generator=shuffle).tolist()]
            offset = (start // count) * count
            expanded += order[start - offset:end - offset]
        by_bucket: dict[tuple, list[int]] = defaultdict(list)
        for j in torch.randperm(len(expanded), generator=generator).tolist():
            by_bucket[self.entries[expanded[j]].group].append(expanded[j])
        batches = [
            members[start:start + self.batch_size]
            for _, members in sorted(by_bucket.items())
            for start in range(0, len(members), self.batch_size)
        ]
        return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]

    def collate(self, indices: list[int], device: torch.device, epoch: int = 0, batch_index: int = 0) -> Batch:
        """The batch's tensors on `device`; varying caption options drawn for (epoch, batch_index)."""
        return self.finish(self.assemble(indices, epoch, batch_index, pin=device.type == "cuda"), device)

    def assemble(self, indices: list[int], epoch: int = 0, batch_index: int = 0, pin: bool = False) -> HostBatch:
        """The CPU half of a batch (of this rank's share of it): cache reads, pixel augmentations,
        stacking. Thread-safe, and a pure function of its arguments."""
        share = batch_share(indices, self.rank, self.world)
        entries = [self.entries[i] for i in share.indices]
        rngs = [caption_rng(self.seed, epoch, batch_index, share.first + position) for position in range(len(entries))]
        # each sample's stream draws its flip first, then (fresh latents) its crop and colour, then its caption
        flipped = [e.flip and rng.random() < 0.5 for e, rng in zip(entries, rngs)]
        latents = pixels = control_latents = pixel_conditioning = None
        if self.fresh is None:
            latent_keys = [e.latent_key + FLIPPED if flip else e.latent_key for e, flip in zip(entries, flipped)]
            latents = _pinned(torch.stack([self.latents[k] for k in latent_keys]), pin)
            pixel_conditioning = {name: _pinned(torch.stack([cached[k] for k in latent_keys]), pin)
                                  for name, cached in self.pixel_conditioning.items()} or None
            sample_masks = [self.masks[k] if k in self.masks else None for k in latent_keys]
            positions = [(0.5, 0.5)] * len(entries)
            if entries[0].control_keys:  # mirrored exactly when their target is
                controls = [torch.stack([self.latents[k + FLIPPED if flip else k] for k in e.control_keys])
                            for e, flip in zip(entries, flipped)]
                control_latents = _pinned(torch.stack(controls), pin)
        else:
            pixels, sample_masks, positions, control_latents = self.fresh.load(entries, flipped, rngs)
            pixels = _pinned(pixels, pin)
            control_latents = None if control_latents is None else _pinned(control_latents, pin)  # pixels, here
        image_info = torch.tensor([_image_info(e, p) for e, p in zip(entries, positions)], dtype=torch.float32)
        text = None
        if entries[0].text_key is not None:
            rows = [self.texts[e.flipped_text_key if flip and e.flipped_text_key else e.text_key]
                    for e, flip in zip(entries, flipped)]
            text = {k: _pinned(torch.stack([row[k] for row in rows]), pin) for k in rows[0]}
        shown = None
        if text is None and self.text_sees_controls and entries[0].item.controls:  # mirrored with their target
            shown = [text_controls(e, flip) for e, flip in zip(entries, flipped)]
        captions = [varied_caption(e.item.caption, e.captions, rng) if e.captions is not None else e.item.caption
                    for e, rng in zip(entries, rngs)]
        return HostBatch(latents, pixels, sample_masks, image_info, text, captions,
                         [e.loss_weight for e in entries], [e.unmasked_weight for e in entries], control_latents,
                         pixel_conditioning, shown)

    def finish(self, host: HostBatch, device: torch.device) -> Batch:
        """The device half of a batch: copies (asynchronous from pinned memory) and, for fresh
        latents, the VAE. Runs on the thread that trains."""
        if host.latents is not None:
            latents, sample_masks = host.latents.to(device, non_blocking=True), host.masks
            pixel_conditioning = None if host.pixel_conditioning is None else {
                name: t.to(device, non_blocking=True) for name, t in host.pixel_conditioning.items()}
        else:
            latents, sample_masks, pixel_conditioning = self.fresh.encode(host.pixels, host.masks, device)
        text = None if host.text is None else {k: t.to(device, non_blocking=True) for k, t in host.text.items()}
        weights = host.loss_weights
        loss_weights = None if all(w == 1.0 for w in weights) else torch.tensor(weights, device=device)
        masks = None
        if any(m is not None for m in sample_masks):
            grid = latents.shape[-2:]
            raw = torch.stack([m if m is not None else torch.ones(1, *grid) for m in sample_masks]).to(device)
            floor = torch.tensor([w if m is not None else 1.0 for w, m in zip(host.unmasked_weights, sample_masks)])
            masks = mask_loss_weights(raw, floor.to(device))
        controls = None if host.controls is None else host.controls.to(device, non_blocking=True)
        if controls is not None and host.latents is None:
            controls = self.fresh.encode_controls(controls, device)
        return Batch(latents, text, host.captions, loss_weights, masks, host.image_info.to(device), controls,
                     pixel_conditioning, host.text_controls)


def _file_hash(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def prepare_dataset(config: TrainConfig, family: ModelFamily, device: torch.device, cache_dir: Path,
                    warn: Callable[[str], None], cache_text: bool, validation: bool = False,
                    stop: StopCheck | None = None) -> TrainDataset:
    """Scan, bucket, and fill the caches, for the training concepts (or, with `validation`, the
    validation concepts). Unreadable images are skipped with a warning naming the file; a concept
    left without any usable image is an error naming its folder."""
    check_concepts(config.concepts)
    concepts = [(i, c) for i, c in enumerate(config.concepts) if c.enabled and c.validation == validation]
    check_controls(config, family, concepts)
    latent_cache = TensorCache(cache_dir / "latents")
    text_cache = TensorCache(cache_dir / "text")
    image_identity = family.fingerprint(*family.image_parts)
    text_identity = stored_text_identity(family) if cache_text else None
    quantum = family.bucket_quantum

    entries: list[Entry] = []
    for index, concept in concepts:
        usable, unmasked = 0, 0
        video = is_video_concept(concept)
        if video:
            _check_video_concept(index, concept, family)
        # a video concept's clips (modules/data/video.py), or images alone or with controls (pairs.py)
        items = scan_concept(index, concept, warn, **video_scan_options(concept)) if video else \
            scan_items(index, concept, warn)
        for item in items:
            item = dataclasses.replace(item, caption=fixed_caption(item.caption, concept.captions))
            if video:
                clips = clip_entries(item, concept, config, family, image_identity, text_identity, warn)
                if clips is not None:  # None: a still image, made below as in any concept
                    entries += clips
                    usable += bool(clips)
                    continue
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
    check_epoch_size(entries, config.concepts)  # before the caches are filled and an epoch's list is built
    _warn_of_surprises(config, family, entries, validation, warn)
    controls = attach_controls(entries, family, image_identity, lambda index: f"concepts[{index}]")

    fresh, reader = None, CacheReader(int(config.data.cache_memory_mb * MB))
    latents: Mapping = {}
    masks: Mapping = {}
    pixel_conditioning: dict[str, Mapping] = {}
    if config.data.cache_latents:
        ready = fill_latents(entries + controls, family, device, latent_cache, warn, stop)
        entries = drop_unready(entries, ready, warn)
        latents = CachedTensors(reader, latent_cache, _latent_index(entries + controls, "latents"))
        masks = CachedTensors(reader, latent_cache, _latent_index([e for e in entries if e.mask], "mask"))
        pixel_conditioning = {name: CachedTensors(reader, latent_cache, _latent_index(entries, PIXEL_CONDITIONING + name))
                              for name in family.pixel_conditioning}
    else:
        fresh = FreshLatents(family, config.data.crop_jitter, config.data.color_jitter)
    for index, concept in concepts:
        if not any(e.item.concept == index for e in entries):
            raise DataError(f"concepts[{index}].path: no usable image in {concept.path}")
    texts: Mapping = {}
    if cache_text:
        fill_texts(entries, family, text_cache, warn, stop)
        spec = family.masked_text_padding
        texts = CachedTensors(reader, text_cache, {k: (k, None) for e in entries
                                                   for k in (e.text_key, e.flipped_text_key) if k},
                              finish=(lambda row: padded(row, spec)) if spec else None)
    dataset = TrainDataset(entries, latents, texts, config.schedule.batch_size, config.seed, masks, fresh, reader,
                           pixel_conditioning, family.text_sees_controls)
    dataset.cache_stats = {"latents": (latent_cache.hits, latent_cache.misses),
                           "text": (text_cache.hits, text_cache.misses)}
    return dataset


def _check_video_concept(index: int, concept, family: ModelFamily) -> None:
    where = f"concepts[{index}]"
    problem = frame_count_problem(concept.video.frames, family.temporal_quantum, family.label)
    if problem:
        raise DataError(f"{where}.video.frames: {problem}")
    if concept.masked_loss:
        raise DataError(f"{where}.masked_loss: loss masks are for still-image concepts (video.frames is "
                        f"{concept.video.frames})")


def clip_entries(item: ConceptItem, concept, config: TrainConfig, family: ModelFamily, image_identity: str | None,
                 text_identity: str | None, warn: Callable[[str], None]) -> list[Entry] | None:
    """A video concept's entries for one item: one per window and resolution; [] for a clip that
    cannot be read (named in a warning); None for a still image. `image_identity` None: entries
    without a latent key, and the clip's bytes are not hashed (the preflight's estimate of a cache
    that holds nothing yet)."""
    try:
        info = probe(item.image)
        if info is None:
            return None
        content = content_hash(item.image) if image_identity is not None else None
    except Exception as error:  # PyAV and PIL raise many kinds for a broken file
        warn(f"skipping unreadable clip {item.image}: {error}")
        return []
    made = []
    for window in clip_windows(item.image, info, concept.video, family.temporal_quantum):
        for resolution in config.data.resolutions:
            bucket = bucket_for(*info.size, resolution, family.bucket_quantum, config.data.aspect_buckets)
            latent_key = cache_key("latent", content, bucket, image_identity, "center-crop", "",
                                   "flip" if config.data.flip else "", "frames", window.indices) if content else ""
            text_key = cache_key("text", item.caption, text_identity) if text_identity is not None else None
            made.append(Entry(item, bucket, latent_key, text_key, concept.repeats, concept.loss_weight,
                              concept.captions if concept.captions.varies else None, None, 1.0,
                              concept.samples_per_epoch, config.data.flip, info.size, window))
    return made


def _warn_of_surprises(config: TrainConfig, family: ModelFamily, entries: list[Entry], validation: bool,
                       warn: Callable[[str], None]) -> None:
    """What trains otherwise than the config reads (data_notes.py), each said once."""
    def where(index: int) -> str:
        return f"concepts[{index}] ({config.concepts[index].path})"

    notes = [] if validation else resolution_notes(config.data.resolutions, family.bucket_quantum, family.label)
    notes += upscale_notes(entries, where) + caption_notes(entries, family, where) + duplicate_notes(entries, where)
    notes += one_frame_notes(entries, family, where)
    for note in notes:
        warn(note)


def _latent_index(entries: list[Entry], name: str) -> dict[str, tuple[str, str]]:
    """Served key -> (cache key, tensor name): `name` under the latent key, its mirrored
    version under the latent key + FLIPPED."""
    index = {}
    for entry in entries:
        index[entry.latent_key] = (entry.latent_key, name)
        if entry.flip:
            index[entry.latent_key + FLIPPED] = (entry.latent_key, f"{name}_flipped")
    return index
