"""Caption options: fixed ones (prefix, suffix) applied once when a concept is scanned, and
varying ones (tag shuffle keeping the first N, tag dropout, caption dropout) drawn anew each time
an image is trained, from a random stream fixed by (seed, epoch, position) so a resumed run sees
the same captions as an uninterrupted one."""

from __future__ import annotations

import random

from modules.config.train_config import CaptionConfig


def fixed_caption(caption: str, options: CaptionConfig) -> str:
    return f"{options.prefix}{caption}{options.suffix}"


def varied_caption(caption: str, options: CaptionConfig, rng: random.Random) -> str:
    if not options.varies:
        return caption
    if options.caption_dropout and rng.random() < options.caption_dropout:
        return ""
    tags = [t.strip() for t in caption.split(options.separator)]
    kept, rest = tags[:options.keep_tags], tags[options.keep_tags:]
    if options.tag_dropout:
        rest = [t for t in rest if rng.random() >= options.tag_dropout]
    if options.shuffle_tags:
        rng.shuffle(rest)
    joiner = options.separator + (" " if options.separator.strip() else "")
    return joiner.join(t for t in kept + rest if t)


def caption_rng(seed: int, epoch: int, batch_index: int, position: int) -> random.Random:
    return random.Random(f"{seed}:{epoch}:{batch_index}:{position}")
