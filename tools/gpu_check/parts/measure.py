"""Figures the GPU parts share: step timing from progress callbacks, peak and pinned memory."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from modules.trainer.callbacks import TrainCallbacks


class StepClock(TrainCallbacks):
    """The time of each optimizer step's progress report (the step's end); warnings kept."""

    def __init__(self):
        self.ends: list[float] = []
        self.warnings: list[str] = []

    def on_progress(self, progress) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())

    def on_warning(self, message: str) -> None:
        self.warnings.append(message)

    def steps_per_s(self) -> float | None:
        """From the second step on (the first includes warm-up)."""
        gaps = [b - a for a, b in zip(self.ends, self.ends[1:])]
        return round(1 / statistics.median(gaps), 3) if gaps else None


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory_figures(device: torch.device) -> dict:
    """Peak allocated and reserved GiB since the last reset, and pinned host bytes held now."""
    if device.type != "cuda":
        return {}
    figures = {"peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
               "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 3)}
    host_stats = getattr(torch.cuda, "host_memory_stats", None)  # (torch >= 2.7)
    if host_stats is not None:
        stats = host_stats()
        # owned: every pinned block torch's host allocator holds (rounded sizes, cached ones too);
        # active: those handed out now
        for key, name in (("allocated_bytes.current", "pinned_owned_gib"), ("active_bytes.current", "pinned_active_gib")):
            if key in stats:
                figures[name] = round(stats[key] / 2**30, 3)
    return figures


def timed_steps(step, steps: int, device: torch.device) -> list[float]:
    """Wall seconds of each call of `step` (the device synchronized around each)."""
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return times
