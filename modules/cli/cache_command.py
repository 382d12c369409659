"""`launch.py cache --config F`: fill the latent and text caches a training run of F would read,
without training (on a machine that is free now, or before a run whose caching would hold up the
train device). A following `launch.py train` with the same config encodes nothing.

It loads the encoders as training would (the same weight modes, so the cache keys are the ones the
run computes) and every other part only as its architecture on the meta device (the denoiser, the
largest part, is never read), moves the encoders to the train device, and builds the caches of the
training and the validation concepts. It holds the workspace lock a training run holds, so it never
runs beside a train of the same workspace. Interrupted, it keeps every entry written; run again, it goes on:
the first SIGINT or SIGTERM stops it between two encoder batches (exit 0), the second at once (130).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from modules.config.train_config import TrainConfig
from modules.errors import UserError
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.commands import TrainCommands


@dataclass
class CacheReport:
    images: int  # training entries (an image at each resolution)
    latents_encoded: int
    texts_encoded: int
    reused: int
    seconds: float
    cache_dir: Path
    stopped: bool = False  # asked to stop: the entries written so far stay

    def summary(self) -> str:
        if self.stopped:
            return f"{self.cache_dir}: stopped; the entries written so far stay (run again to go on)"
        rate = f", {self.latents_encoded / self.seconds:.1f} images/s" if self.latents_encoded and self.seconds else ""
        return (f"{self.cache_dir}: {self.images} images; {self.latents_encoded} latents and {self.texts_encoded} "
                f"captions encoded in {self.seconds:.1f}s{rate}, {self.reused} entries reused")


def build_caches(config: TrainConfig, callbacks: TrainCallbacks | None = None,
                 commands: TrainCommands | None = None) -> CacheReport:
    """`commands`: its stop request ends the build between two encoder batches."""
    from modules.data.concepts import check_concepts
    from modules.trainer.generic_trainer import GenericTrainer
    from modules.trainer.preflight import device_problems, workspace_problem
    from modules.util.stopping import StopRequested

    callbacks = callbacks or TrainCallbacks()
    # before the load: the encoders go to train_device (a CUDA one on a CPU-only torch was a traceback)
    problems = [problem for problem in [workspace_problem(config), *device_problems(config)] if problem]
    if problems:
        raise UserError("\n".join(problems))
    check_concepts(config.concepts)  # before the slow model load
    commands = commands or TrainCommands()
    trainer = GenericTrainer(config, callbacks, commands)  # for its cache folder, device and weight-mode resolution
    # the workspace lock a training run takes: a train of the same workspace writes the same caches
    trainer.lock.acquire()
    commands.quit_hooks.append(trainer.lock.release)  # (a second signal inside one long encode)
    try:
        return _fill(config, callbacks, trainer)
    except StopRequested:
        return CacheReport(0, 0, 0, 0, 0.0, trainer.cache_dir, stopped=True)
    finally:
        commands.quit_hooks.remove(trainer.lock.release)
        trainer.lock.release()


def _fill(config: TrainConfig, callbacks: TrainCallbacks, trainer) -> CacheReport:
    from modules.data.dataset import caches_text, prepare_dataset
    from modules.config.families import get_family_class

    family = get_family_class(config.model.family)(config)
    trainer.family = family
    family.weight_modes = trainer.resolve_weight_modes()
    cache_text = caches_text(config, family)
    encoders = (*family.image_parts, *(family.text_parts if cache_text else ()))
    # every other part (the denoiser, and the text encoders when text is not cached) is built on
    # meta without reading its weights: encoding never runs it
    family.skeleton_parts = frozenset(spec.name for spec in family.part_specs if spec.name not in encoders)
    _say_video_estimate(config, family, callbacks)
    callbacks.on_status("loading model")
    family.load()
    for part in encoders:
        family.parts[part].to(trainer.device)
    started = time.monotonic()
    callbacks.on_status("caching latents and text")
    counts = []
    sets = [False] + ([True] if any(c.enabled and c.validation for c in config.concepts) else [])
    for validation in sets:
        dataset = prepare_dataset(config, family, trainer.device, trainer.cache_dir, callbacks.on_warning,
                                  cache_text, validation=validation, stop=lambda: trainer.commands.stop_requested)
        counts.append((len(dataset.entries), dataset.cache_stats))
    (images, _), stats = counts[0], [s for _, s in counts]
    return CacheReport(images, sum(s["latents"][1] for s in stats), sum(s["text"][1] for s in stats),
                       sum(s["latents"][0] + s["text"][0] for s in stats), time.monotonic() - started,
                       trainer.cache_dir)


def _say_video_estimate(config: TrainConfig, family, callbacks: TrainCallbacks) -> None:
    """Before any clip is decoded: what the video concepts give, and whether their cache fits."""
    from modules.trainer.video_preflight import cache_space_problem, estimate_video_cache

    estimate = estimate_video_cache(config, family)
    if estimate is None:
        return
    callbacks.on_status(estimate.summary())
    problem = cache_space_problem(estimate)
    if problem:
        raise UserError(problem)
