"""The layer offload conductor's cost per training step on CPU, relative to no conductor.

    python -m benchmarks.offload [--work DIR] [--size small] [--device cpu] [--rounds 4] [--steps 3]

Two trainers on the same model and data in one process, both with gradient checkpointing, one
with offload_fraction 0 and one with 0.5; their forward+backward steps alternate in rounds, so a
busy machine slows both alike. On the CPU the moves are no-ops (train and temp device are the
same), so this is the cost of the hooks and the schedule alone. `--device fakegpu` uses the fake
second device from tests/fake_device.py, where moves are real copies between two memories.
Prints the median step time of each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", default="/tmp/difftrainer-bench")
    parser.add_argument("--size", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per trainer per round")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))
    from benchmarks.models import SIZES, build_model, write_images
    from modules.config.loading import build_config
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer
    from modules.util.library_logs import quiet_library_logs

    quiet_library_logs()
    if args.device == "fakegpu":
        from fake_device import enable_fake_device

        enable_fake_device()
    work = Path(args.work)
    model, images = work / f"model-{args.size}", work / f"images-{args.size}"
    if not model.exists():
        build_model(args.size, model)
    if not images.exists():
        write_images(images)
    trainers = {}
    for fraction in (0.0, 0.5):
        config = build_config([{
            "model": {"base": str(model), "parts": {"unet": {"gradient_checkpointing": True,
                                                             "offload_fraction": fraction}}},
            "concepts": [{"path": str(images)}], "data": {"resolution": SIZES[args.size]["resolution"]},
            "adapter": {"rank": 16, "alpha": 16, "layer_preset": "attn-mlp"},
            "schedule": {"batch_size": SIZES[args.size]["batch"]},
            "workspace_dir": str(work / f"ws-offload-{fraction}"), "output": {"path": str(work / "out.safetensors")},
            "tensorboard": False, "train_device": args.device,
        }])
        trainer = GenericTrainer(config, TrainCallbacks())
        trainer.start()
        trainers[fraction] = trainer
    batch = list(range(SIZES[args.size]["batch"]))
    times: dict[float, list[float]] = {0.0: [], 0.5: []}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for fraction, trainer in trainers.items():
            for _ in range(args.steps):
                started = time.perf_counter()
                trainer._forward(batch, torch.float32).backward()
                if round_index:
                    times[fraction].append(time.perf_counter() - started)
    plain, offloaded = statistics.median(times[0.0]), statistics.median(times[0.5])
    conductor = trainers[0.5].conductors["unet"]
    print(f"{args.size} on {args.device}: {conductor.describe()}")
    print(f"offload 0: {plain:.3f} s/step; offload 0.5: {offloaded:.3f} s/step; ratio {offloaded / plain:.3f}")


if __name__ == "__main__":
    main()
