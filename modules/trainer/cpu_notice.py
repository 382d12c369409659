"""On the CPU, say so and what a step will cost before the first one (with a full-size model the
first step can take many minutes, and a silent run looks hung).

The cost is measured, not guessed from a table: forward passes of the real denoiser, in the run's
dtype, on centre crops of a real batch's latents at a quarter and at half of its side. Their ratio
gives how the cost grows with the area here (about linearly where convolutions dominate, up to
quadratically where attention does), which carries the half-size time to the full size; a step
is about three forwards (forward plus backward) per accumulated batch. Measuring costs about a
twelfth of a step or less.
"""

from __future__ import annotations

import math
import time

import torch

from modules.util.torch_utils import autocast, dtype_of, make_generator

# below this many denoiser parameters a step takes seconds at most: no notice, no measurement
NOTICE_MIN_PARAMETERS = 50_000_000


def _forward_seconds(trainer, latents: torch.Tensor, conditioning: dict, height: int, width: int) -> float:
    top, left = (latents.shape[-2] - height) // 2, (latents.shape[-1] - width) // 2
    crop = latents[..., top:top + height, left:left + width].contiguous()
    generator = make_generator(trainer.device, trainer.config.seed)  # not the run's: its draws stay as they are
    started = time.perf_counter()
    with torch.no_grad(), autocast(trainer.device, dtype_of(trainer.config.train_dtype)):
        trainer.family.predict(crop, conditioning, generator)
    return time.perf_counter() - started


def _side(full: int, divisor: int) -> int:
    return max(2, full // divisor // 2 * 2)  # even: families that pack 2x2 patches need it


def estimate_step_seconds(trainer) -> float | None:
    """Seconds one optimizer step will take, or None where the latents are too small to measure on."""
    batch = trainer.dataset.collate(trainer.dataset.epoch_batches(trainer.epoch)[0], trainer.device)
    height, width = batch.latents.shape[-2:]
    if min(height, width) < 8:
        return None
    conditioning = trainer.conditioning(batch)
    quarter, half = (_side(height, 4), _side(width, 4)), (_side(height, 2), _side(width, 2))
    with torch.random.fork_rng(devices=[]):  # dropout draws from the global RNG: keep the run's
        _forward_seconds(trainer, batch.latents, conditioning, *quarter)  # warm-up (first-call costs)
        small = _forward_seconds(trainer, batch.latents, conditioning, *quarter)
        large = _forward_seconds(trainer, batch.latents, conditioning, *half)
    growth = (half[0] * half[1]) / (quarter[0] * quarter[1])
    exponent = min(2.0, max(1.0, math.log(max(large, 1e-9) / max(small, 1e-9)) / math.log(growth)))
    forward = large * ((height * width) / (half[0] * half[1])) ** exponent
    return 3 * forward * trainer.config.schedule.gradient_accumulation


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def cpu_notice(trainer) -> str | None:
    """The line to show before the first step of a run on the CPU, or None (another device, a small model)."""
    if trainer.device.type != "cpu":
        return None
    denoiser = trainer.family.denoiser_part
    parameters = sum(p.numel() for p in trainer.family.parts[denoiser].parameters())
    if parameters < NOTICE_MIN_PARAMETERS:
        return None
    text = (f"train_device: training runs on the CPU ({trainer.config.train_device}); the {denoiser} has "
            f"{parameters / 1e6:.0f}M parameters")
    seconds = estimate_step_seconds(trainer)
    if seconds is None:
        return text + "; steps will be slow"
    remaining = trainer.total_steps - trainer.step
    return (text + f": one step will take roughly {_duration(seconds)} or more (measured on smaller crops), "
            f"the {remaining} steps roughly {_duration(seconds * remaining)}. A CUDA GPU is orders of magnitude faster.")
