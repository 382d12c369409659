"""Which parts a training step runs, and so which it never does (idle parts).

The step runs the denoiser and every trained part; the text encoders only where the text is not
cached (caches_text: a trained encoder, an embedding, varying captions), the image encoders only
where the latents are not (data.cache_latents off: fresh latents per batch, with the pixel
conditioning drawn from them). Every other part is idle in the step: it runs while the caches are
filled and while samples are made, and waits on the temp device in between (the trainer's
trainer/idle_parts.py; the plan counts it the same, plan/run_plan.py). A part that only sampling
ever runs (family.resting_parts) is not on the train device at all, caching included, and is left
to that rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modules.config.train_config import TrainConfig
    from modules.model.base import ModelFamily


def step_parts(config: TrainConfig, family: ModelFamily, trained: Iterable[str], text_cached: bool) -> set[str]:
    """The parts the training step runs. `trained`: the parts the step trains (adapters, weights or
    embeddings); `text_cached`: whether the step reads the text from the cache."""
    parts = {family.denoiser_part, *trained}
    if not text_cached:
        parts.update(family.text_parts)
    if not config.data.cache_latents:
        parts.update(family.image_parts)
    return parts


def idle_parts(config: TrainConfig, family: ModelFamily, trained: Iterable[str], text_cached: bool) -> tuple[str, ...]:
    """The parts, in the family's order, that the training step never runs but caching does."""
    running = step_parts(config, family, trained, text_cached)
    resting = set(family.resting_parts())
    return tuple(name for name in config.model.parts if name not in running and name not in resting)
