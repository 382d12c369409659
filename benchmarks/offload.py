"""The layer offload conductor's cost per training step on CPU, relative to no conductor.

    python -m benchmarks.offload [--work DIR] [--steps 6] [--size small]

Four runs of the same LoRA training (gradient checkpointing on in all of them), each in a fresh
process: train device `cpu` with offload_fraction 0 and 0.5 (the moves are no-ops: this is the
hooks' and the schedule's own cost), and the fake second device from tests/fake_device.py with
0 and 0.5 (real copies between two memories). Prints the median step time of each and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_child(model: Path, images: Path, work: Path, device: str, fraction: float, steps: int) -> list[float]:
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))
    from modules.config.loading import build_config
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer
    from modules.util.library_logs import quiet_library_logs

    quiet_library_logs()
    if device == "fakegpu":
        from fake_device import enable_fake_device

        enable_fake_device()

    class Clock(TrainCallbacks):
        def __init__(self):
            self.marks = []

        def on_progress(self, progress):
            self.marks.append(time.perf_counter())

    config = build_config([{
        "model": {"base": str(model), "parts": {"unet": {"gradient_checkpointing": True,
                                                         "offload_fraction": fraction}}},
        "concepts": [{"path": str(images)}], "data": {"resolution": 128},
        "adapter": {"rank": 16, "alpha": 16, "layer_preset": "attn-mlp"},
        "schedule": {"epochs": 100, "max_steps": steps, "batch_size": 2},
        "workspace_dir": str(work / f"ws-{device}-{fraction}"), "output": {"path": str(work / "out.safetensors")},
        "tensorboard": False, "train_device": device,
    }])
    clock = Clock()
    trainer = GenericTrainer(config, clock)
    trainer.start()
    clock.marks = [time.perf_counter()]
    trainer.train()
    return [b - a for a, b in zip(clock.marks, clock.marks[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", default="/tmp/difftrainer-bench")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--size", default="small")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, images, work, device, fraction = args.child
        print(json.dumps(run_child(Path(model), Path(images), Path(work), device, float(fraction), args.steps)))
        return

    from benchmarks.models import build_model, write_images

    work = Path(args.work)
    model, images = work / f"model-{args.size}", work / f"images-{args.size}"
    if not model.exists():
        build_model(args.size, model)
    if not images.exists():
        write_images(images)
    medians = {}
    for device in ("cpu", "fakegpu"):
        for fraction in (0.0, 0.5):
            out = subprocess.run([sys.executable, "-m", "benchmarks.offload", "--steps", str(args.steps), "--child",
                                  str(model), str(images), str(work), device, str(fraction)],
                                 cwd=REPO, check=True, capture_output=True, text=True).stdout
            times = json.loads(out.strip().splitlines()[-1])
            medians[(device, fraction)] = statistics.median(times[1:])
            print(f"{device} offload {fraction}: median step {medians[(device, fraction)]:.3f} s", flush=True)
    for device in ("cpu", "fakegpu"):
        print(f"{device}: offload 0.5 / 0 = {medians[(device, 0.5)] / medians[(device, 0.0)]:.3f}")


if __name__ == "__main__":
    main()
