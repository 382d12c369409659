"""Filling the latent and text caches: what is missing is encoded on the train device in batches
(images that share a bucket size go through the VAE together) and written entry by entry, so an
interrupted build resumes where it stopped (the content-addressed keys find what was written).

Images are decoded and resized on a thread pool ahead of the encoder, and entries are written by a
writer thread behind it, so the device is not kept waiting on PIL or the disk. Nothing encoded is
kept in memory after it is written: training reads it back lazily (cache_reader.py).
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
from tqdm import tqdm

from modules.data.cache import TensorCache
from modules.data.cache_layout import Layout, expected_latent_layout, fits, measure_grid, measure_text_layout
from modules.data.video import load_entry_pixels
from modules.data.masks import latent_mask, load_mask
from modules.data.pairs import text_controls
from modules.data.text_padding import PaddingSpec, real_token_layout, real_tokens
from modules.util.stopping import StopCheck, raise_if_stopping

if TYPE_CHECKING:
    from modules.data.dataset import Entry
    from modules.model.base import ModelFamily

ENCODE_BATCH = 4  # images per VAE call (and captions per text encoder call)
LOAD_AHEAD = 3  # batches of pixels decoded ahead of the encoder
LOAD_THREADS = 2


def caching_progress(total: int, what: str, unit: str) -> tqdm:
    """A tqdm bar on stderr while the encoders run (minutes for a big data set on a slow machine),
    with the rate and the time left; tqdm turns it off where stderr is no terminal (the GUI and
    log files get the summary line)."""
    return tqdm(total=total, desc=what, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
                disable=None if total else True)


PIXEL_CONDITIONING = "pixel."  # the prefix of a family's pixel conditioning in a latent entry


def needed_latent_names(entry: Entry, family: ModelFamily | None = None) -> set[str]:
    names = {"latents"} | {PIXEL_CONDITIONING + name for name in (family.pixel_conditioning if family else ())}
    names |= {f"{name}_flipped" for name in names} if entry.flip else set()
    return names | ({"mask"} if entry.mask else set())


class _Writer:
    """Cache entries written on one background thread, in order; an error is raised on the caller's
    next call (or at close), and close waits for every write already handed over."""

    def __init__(self, cache: TensorCache):
        self.cache = cache
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-writer")
        self.pending: list[Future] = []

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        self._raise_done()
        self.pending.append(self.pool.submit(self.cache.put, key, tensors))

    def _raise_done(self) -> None:
        done = [f for f in self.pending if f.done()]
        self.pending = [f for f in self.pending if not f.done()]
        for future in done:
            future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)  # also after an interrupt: what was encoded is kept for the next run
        self._raise_done()


@contextlib.contextmanager
def one_image_per_encoder_call(family: ModelFamily):
    """Inside the block each image part that can (diffusers' VAEs: `use_slicing`) encodes a chunk's
    images one at a time: a chunk holds ENCODE_BATCH images (twice that with their mirrored copies),
    and a VAE's activations grow with its batch (the plan of SDXL's float32 VAE over 4 images at
    1024 px: 10.1 GiB, one at a time 2.5), while its weights stay resident either way. The plan's
    caching pass runs in the same block (modules/plan/phase_pass.py)."""
    modules = getattr(family, "parts", {})  # (a stand-in family of the data tests' has none)
    parts = [modules[name] for name in getattr(family, "image_parts", ()) if hasattr(modules.get(name), "use_slicing")]
    before = [part.use_slicing for part in parts]
    try:
        for part in parts:
            part.use_slicing = True
        yield
    finally:
        for part, was in zip(parts, before):
            part.use_slicing = was


def _load_chunk(group: list[Entry], width: int, height: int):
    pixels, ready, failed = [], [], []
    for entry in group:
        try:
            pixels.append(load_entry_pixels(entry, width, height))
            ready.append(entry)
        except Exception as error:  # PIL raises many kinds for a broken file
            failed.append((entry, error))
    return pixels, ready, failed


def _ahead(pool: ThreadPoolExecutor, jobs: Iterable[tuple], work: Callable, depth: int) -> Iterator:
    """work(*job) for each job, in order, at most `depth` running ahead of the consumer."""
    queued: list[Future] = []
    for job in jobs:
        queued.append(pool.submit(work, *job))
        if len(queued) > depth:
            yield queued.pop(0).result()
    for future in queued:
        yield future.result()


@torch.no_grad()
def fill_latents(entries: list[Entry], family: ModelFamily, device: torch.device, cache: TensorCache,
                 warn: Callable[[str], None], stop: StopCheck | None = None) -> set[str]:
    """Encode and write every entry's latents (its mirrored image's and its mask on the latent grid
    too, where it uses them) that the cache lacks; the latent keys whose entries are complete.
    `stop` is asked before each encoder call: StopRequested then ends the build (what is written stays)."""
    ready: set[str] = set()
    todo: dict[tuple, list[Entry]] = defaultdict(list)  # by bucket and frame count: what encodes together
    seen: set[str] = set()
    grid, stale = None, 0
    for entry in entries:
        if entry.latent_key in seen:
            continue
        seen.add(entry.latent_key)
        layout = cache.layout(entry.latent_key)
        if layout is not None and needed_latent_names(entry, family) <= set(layout):
            grid = grid or measure_grid(family, device)  # (once, for the first entry found)
            if fits(layout, expected_latent_layout(entry, grid)):
                ready.add(entry.latent_key)
                continue
            cache.count_stale()
            stale += 1
        todo[entry.group].append(entry)
    if stale:
        warn(f"{stale} latent cache entr{'y' if stale == 1 else 'ies'} in {cache.folder} held tensors of other "
             "shapes or dtypes than their image, bucket and model give (damaged, or written by another "
             "program?); encoding them again")
    chunks = [(group[start:start + ENCODE_BATCH], *bucket)
              for (bucket, _), group in todo.items() for start in range(0, len(group), ENCODE_BATCH)]
    bar = caching_progress(sum(len(group) for group in todo.values()), "encoding latents", "image")
    writer = _Writer(cache)
    loaders = ThreadPoolExecutor(max_workers=LOAD_THREADS, thread_name_prefix="cache-loader")
    try:
        with one_image_per_encoder_call(family):  # a chunk's images through the VAE one by one
            for (pixels, chunk, failed), (_, width, height) in zip(_ahead(loaders, chunks, _load_chunk, LOAD_AHEAD),
                                                                   chunks):
                for entry, error in failed:
                    warn(f"skipping unreadable image {entry.item.image}: {error}")
                raise_if_stopping(stop)
                if chunk:
                    _encode_chunk(chunk, pixels, width, height, family, device, writer)
                    ready.update(entry.latent_key for entry in chunk)
                bar.update(len(chunk) + len(failed))
    finally:
        loaders.shutdown(wait=True, cancel_futures=True)
        writer.close()
        bar.close()
    return ready


def _encode_chunk(chunk: list[Entry], pixels: list[torch.Tensor], width: int, height: int,
                  family: ModelFamily, device: torch.device, writer: _Writer) -> None:
    # the mirrored images go through the same VAE call: the mirrored image is encoded, not the
    # latent mirrored, because the VAE is not symmetric
    mirrored = [p.flip(-1) for p, entry in zip(pixels, chunk) if entry.flip]
    stacked = torch.stack(pixels + mirrored).to(device)
    encoded = {"latents": family.encode_images(stacked).float().cpu()}
    if family.pixel_conditioning:
        encoded |= {PIXEL_CONDITIONING + name: tensor.float().cpu()
                    for name, tensor in family.encode_pixel_conditioning(stacked).items()}
    plain, flipped = 0, len(pixels)
    for entry in chunk:
        latent = encoded["latents"][plain]
        stored = {name: tensor[plain].clone() for name, tensor in encoded.items()}
        plain += 1
        if entry.flip:
            stored |= {f"{name}_flipped": tensor[flipped].clone() for name, tensor in encoded.items()}
            flipped += 1
        if entry.mask is not None:
            stored["mask"] = latent_mask(load_mask(entry.mask, width, height), *latent.shape[-2:])
            if entry.flip:
                stored["mask_flipped"] = stored["mask"].flip(-1)
        writer.put(entry.latent_key, stored)


@torch.no_grad()
def fill_texts(entries: list[Entry], family: ModelFamily, cache: TensorCache,
               warn: Callable[[str], None], stop: StopCheck | None = None) -> set[str]:
    """Encode and write the conditioning of every caption the cache lacks; the text keys present
    (`stop`: as in fill_latents). For a family whose text encoder sees the control images, each
    sample's caption is encoded with its controls (and, where it is mirrored, again with them
    mirrored: its flipped_text_key), those of one bucket and control count together."""
    ready: set[str] = set()
    todo: dict[tuple, dict[str, tuple[Entry, bool]]] = defaultdict(dict)  # by what encodes together
    references: dict[tuple, dict] = {}
    stale = 0
    for entry in entries:
        with_controls = bool(entry.item.controls) and family.text_sees_controls
        group = (entry.bucket, len(entry.item.controls)) if with_controls else ()
        for key, mirrored in ((entry.text_key, False), (entry.flipped_text_key, True)):
            if key is None or key in ready or key in todo[group]:
                continue
            layout = cache.layout(key)
            if layout:  # an empty entry is as good as none
                if group not in references:  # (once per group: the shapes a fresh encoding has)
                    references[group] = measure_text_layout(
                        family, entry.item.caption, text_controls(entry, False) if with_controls else None)
                expected = _stored_layout(cache, key, references[group], family.masked_text_padding)
                if expected is not None and fits(layout, expected):
                    ready.add(key)
                    continue
                cache.count_stale()
                stale += 1
            todo[group][key] = (entry, mirrored)
    if stale:
        warn(f"{stale} text cache entr{'y' if stale == 1 else 'ies'} in {cache.folder} held tensors of other shapes "
             "or dtypes than the text encoders give (damaged, or written by another program?); encoding them again")
    chunks = [(group, keys[start:start + ENCODE_BATCH]) for group, jobs in todo.items() for keys in [list(jobs)]
              for start in range(0, len(keys), ENCODE_BATCH)]
    bar = caching_progress(sum(len(jobs) for jobs in todo.values()), "encoding captions", "caption")
    writer = _Writer(cache)
    try:
        for group, chunk in chunks:
            raise_if_stopping(stop)
            jobs = [todo[group][k] for k in chunk]
            captions = [entry.item.caption for entry, _ in jobs]
            if group:
                tokens = family.tokenize(captions, controls=[text_controls(e, mirrored) for e, mirrored in jobs])
            else:
                tokens = family.tokenize(captions)
            encoded = family.encode_text(tokens)
            for row, key in enumerate(chunk):
                stored = {name: t[row] for name, t in encoded.items()}
                if family.masked_text_padding:  # only the real tokens (text_padding.py)
                    stored = real_tokens(stored, family.masked_text_padding)
                writer.put(key, {name: t.float().cpu().clone() for name, t in stored.items()})
                ready.add(key)
            bar.update(len(chunk))
    finally:
        writer.close()
        bar.close()
    return ready


def _stored_layout(cache: TensorCache, key: str, whole: Layout, spec: PaddingSpec) -> Layout | None:
    """What the entry `key` must hold: a whole encoding's layout, or for a family that stores only
    the real tokens, that layout cut to the counts of the entry's own masks (read alone: they are
    small); None when its masks cannot be read (the entry is then encoded again)."""
    if not spec:
        return whole
    masks = cache.tensors(key, {mask for mask, _ in spec.values()})
    if masks is None or any(tuple(masks[mask].shape) != whole[mask][1] for mask in masks):
        return None
    return real_token_layout(whole, spec, {mask: int(t.bool().sum()) for mask, t in masks.items()})
