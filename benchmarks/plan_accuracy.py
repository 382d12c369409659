"""The plan against the run (issue 25): planned train-device peak vs the peak the real trainer reaches
on the fake device with capacity (tests/fake_device.py: torch.fakegpu.max_memory_allocated over
start, caching included, and two steps), for every weight mode that runs here x offload_fraction {0, 0.5} x
gradient checkpointing x method (adapter; fine-tune with and without the fused backward), on the tiny and
small SD1.5 models (benchmarks/models.py) at 64 and 128 px, batch 2. Also the host side: the bytes
parked in RAM as planned vs the parked blocks' bytes the run's conductor holds there.

  python -m benchmarks.plan_accuracy [--sizes tiny small] [--modes bfloat16 float8 int8] [--methods adapter ...]

A fine-tune trains dense weights only (a quantized trained part is refused), a trained part that
parks blocks needs checkpointing, and a fine-tune parks only with the fused backward: those
combinations are left out, as the config refuses them.
Prints one table row per run: planned, measured, planned/measured. Not a GPU figure.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]

METHODS = {
    "adapter": {},
    "fine-tune fused": {"method": {"type": "fine_tune", "fused_backward": True}},
    "fine-tune unfused": {"method": {"type": "fine_tune", "fused_backward": False}},
}
RESOLUTION = {"tiny": 64, "small": 128}


class MeasuredRun(NamedTuple):
    peak: int  # the whole run's: loading, filling the caches and training (what the plan's device_peak is)
    training_peak: int  # the training's alone (what the plan's step_peak is)
    steps: int
    inspected: object


def measured_device_peak(config, inspect=None) -> MeasuredRun:
    """Train `config` (on the fake device): the most bytes it held there over what the device held
    before, over the whole run and over the training alone, the steps it took and `inspect(trainer)`
    read before the trainer is released. The trainer resets the device's peaks as training starts
    (trainer/memory_report.py), so what loading and caching reached is read before that."""
    import torch

    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer

    memory = torch.get_device_module(config.train_device)  # fakegpu: registered by tests/fake_device.py
    gc.collect()  # an earlier run's tensors freed during this one would lower its peak over `before`
    memory.reset_peak_memory_stats()
    before = memory.memory_allocated()
    trainer = GenericTrainer(config, TrainCallbacks())
    trainer.start()
    setup = memory.max_memory_allocated() - before  # the load and the caches (reset as training starts)
    trainer.train()
    training = memory.max_memory_allocated() - before
    inspected = inspect(trainer) if inspect is not None else None
    steps = trainer.step
    trainer.release()
    return MeasuredRun(max(setup, training), training, steps, inspected)


def cases(modes: list[str], methods: list[str]):
    for method in methods:
        for mode in modes:
            if method != "adapter" and mode not in ("bfloat16", "float32"):
                continue  # a quantized part does not train its weights
            for offload in (0.0, 0.5):
                for checkpointing in (False, True):
                    if offload and not checkpointing:
                        continue  # a trained part's parked blocks are recomputed: the config refuses it
                    if offload and method == "fine-tune unfused":
                        continue  # a fine-tune parks its blocks only with the fused backward (refused)
                    yield method, mode, offload, checkpointing


def measure(model: Path, images: Path, work: Path, size: str, method: str, mode: str, offload: float,
            checkpointing: bool) -> tuple[int, int, int, int]:
    """(planned device peak, measured device peak, planned parked bytes, measured parked bytes)."""
    from modules.config.loading import build_config
    from modules.offload.layer_tensors import block_bytes
    from modules.plan.run_plan import plan_run

    config = build_config([{
        "model": {"base": str(model), "parts": {"unet": {"weight_dtype": mode, "offload_fraction": offload,
                                                          "gradient_checkpointing": checkpointing}}},
        "concepts": [{"path": str(images)}], "data": {"resolution": RESOLUTION[size]},
        "schedule": {"epochs": 1, "batch_size": 2, "max_steps": 2}, "train_device": "fakegpu",
        "workspace_dir": str(work / "ws"), "output": {"path": str(work / "out.safetensors")},
        "tensorboard": False, "sampling": {"prompts": []}}, METHODS[method]])
    plan = plan_run(config, None, None)

    def parked_bytes(trainer) -> int:
        conductor = trainer.conductors.get("unet")
        return sum(block_bytes(conductor.blocks[index]) for index in conductor.parked) if conductor else 0

    run = measured_device_peak(config, parked_bytes)
    return plan.device_peak, run.peak, sum(p.parked for p in plan.parts.values()), run.inspected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=list(RESOLUTION))
    parser.add_argument("--modes", nargs="+", default=["bfloat16", "float8", "int8"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))
    from fake_device import enable_fake_device

    from benchmarks.models import build_model, write_images

    enable_fake_device()
    print("| model | method | weights | offload | checkpointing | planned MiB | measured MiB | planned/measured "
          "| parked MiB planned / run |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for size in args.sizes:
            model = build_model(size, root / f"model-{size}")
            images = write_images(root / f"images-{size}", RESOLUTION[size])
            for number, (method, mode, offload, checkpointing) in enumerate(cases(args.modes, args.methods)):
                planned, measured, parked_plan, parked_run = measure(
                    model, images, root / f"run-{size}-{number}", size, method, mode, offload, checkpointing)
                ratio = planned / measured
                worst = max(worst, abs(ratio - 1))
                print(f"| {size} | {method} | {mode} | {offload:g} | {'on' if checkpointing else 'off'} | "
                      f"{planned / 2**20:.1f} | {measured / 2**20:.1f} | {ratio:.3f} | "
                      f"{parked_plan / 2**20:.1f} / {parked_run / 2**20:.1f} |", flush=True)
    print(f"\nlargest |planned/measured - 1|: {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
