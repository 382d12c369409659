"""Quantized base weights on the `small` SD1.5 config: bytes, step time and load memory per mode.

    python -m benchmarks.quantization [--work DIR] [--steps 8] [--modes float32 bfloat16 float8 ...]

Per mode, each in a fresh process:
- weight bytes of the quantized layers relative to the same layers in bfloat16 (goal: fp8/int8
  <= 0.52x, nf4 <= 0.30x), and of the whole UNet relative to a bfloat16 UNet (everything not
  quantized is stored in train_dtype, bfloat16 here);
- median training step time (LoRA, attention + MLP, train_dtype float32) relative to dense
  float32, skipping the first step;
- peak resident memory of the load relative to the final model (benchmarks/load_memory.py).
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
MODES = ["float32", "bfloat16", "float8", "int8", "w8a8_int8", "w8a8_fp8", "nf4"]


def step_times(model: Path, images: Path, work: Path, mode: str, steps: int) -> list[float]:
    """Run in the child: train `steps` steps and return each step's wall time."""
    sys.path.insert(0, str(REPO))
    from modules.config.loading import build_config
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer
    from modules.util.library_logs import quiet_library_logs

    quiet_library_logs()

    class Clock(TrainCallbacks):
        def __init__(self):
            self.marks = [time.perf_counter()]

        def on_progress(self, progress):
            self.marks.append(time.perf_counter())

    config = build_config([{
        "model": {"base": str(model), "parts": {"unet": {"weight_dtype": mode}}},
        "concepts": [{"path": str(images)}], "data": {"resolution": 128},
        "adapter": {"rank": 16, "alpha": 16, "layer_preset": "attn-mlp"},
        "schedule": {"epochs": 100, "max_steps": steps, "batch_size": 2},
        "workspace_dir": str(work / f"ws-{mode}"), "output": {"path": str(work / f"out-{mode}.safetensors")},
        "tensorboard": False, "train_device": "cpu", "train_dtype": "float32",
    }])
    clock = Clock()
    trainer = GenericTrainer(config, clock)
    trainer.start()
    clock.marks = [time.perf_counter()]
    trainer.train()
    return [b - a for a, b in zip(clock.marks, clock.marks[1:])]


def child(argv: list[str]) -> list[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks.quantization", *argv], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout.strip().splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", default="/tmp/difftrainer-bench")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=MODES)
    parser.add_argument("--memory-only", action="store_true", help="skip the training steps")
    parser.add_argument("--child-steps", nargs=4, metavar=("MODEL", "IMAGES", "WORK", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_steps:
        model, images, work, mode = args.child_steps
        print(json.dumps(step_times(Path(model), Path(images), Path(work), mode, args.steps)))
        return

    from benchmarks.models import build_model, write_images

    work = Path(args.work)
    model, images = work / "model-small", work / "images-small"
    if not model.exists():
        build_model("small", model)
    if not images.exists():
        write_images(images)
    rows = {}
    for mode in args.modes:
        memory = json.loads(subprocess.run(
            [sys.executable, "-m", "benchmarks.load_memory", "--model", str(model), "--mode", mode,
             "--train-dtype", "bfloat16"], cwd=REPO, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        if args.memory_only:
            rows[mode] = {**memory, "step_s": None}
        else:
            times = json.loads(child(["--steps", str(args.steps), "--child-steps", str(model), str(images), str(work),
                                      mode])[-1])
            rows[mode] = {**memory, "step_s": statistics.median(times[1:])}
        print(json.dumps(rows[mode]), flush=True)
    bf16, dense = rows.get("bfloat16"), rows.get("float32")
    print("\n| mode | quantized layers / bf16 | UNet bytes / bf16 UNet | step time / float32 | load peak / final |")
    print("|---|---|---|---|---|")
    for mode, row in rows.items():
        quantized = f"{row['quantized_over_bf16']:.3f}" if row.get("quantized_over_bf16") else "-"
        unet = f"{row['unet_mb'] / bf16['unet_mb']:.3f}" if bf16 else "-"
        if row["step_s"] is None:
            step = "-"
        else:
            step = f"{row['step_s'] / dense['step_s']:.2f} ({row['step_s']:.2f} s)" if dense else f"{row['step_s']:.2f} s"
        print(f"| {mode} | {quantized} | {unet} | {step} | {row['peak_over_final']:.3f} |")


if __name__ == "__main__":
    main()
