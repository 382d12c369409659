"""Peak memory of a full fine-tune of the `small` benchmark UNet (~35M parameters), with and
without the fused backward, per optimizer (issue 16's goal: gradient memory gone, <= 0.6x peak at
AdamW8bit).

Each case runs the real trainer in its own process on the CPU. Memory is the process's resident
set, sampled every 2 ms from /proc/self/statm, with glibc told to serve every allocation above
64 KiB by mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once and it
follows live tensor memory. Reported per case, in MiB:
- `loaded`: after start() (model, data cache) minus before it (imports only),
- `peak`: the highest resident set in training steps 2..N minus the same imports-only baseline
  (step 1 is left out: the first-step guard holds a copy of the trained weights then, in every case),
- `peak/unfused`: that peak over the unfused peak with the same optimizer,
- `grads`: the size of all UNet gradients (what the fused backward should save).
The UNet trains with gradient checkpointing at batch 1 (as a large fine-tune would), so
activations do not hide the weights, gradients and optimizer state.

    python -m benchmarks.fine_tune_memory                       # adamw and adamw_8bit, fp32 weights
    python -m benchmarks.fine_tune_memory --optimizers adamw --steps 4 --weights bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(model: str, images: str, work: str, optimizer: str, fused: bool, steps: int, weights: str) -> dict:
    """One case, in this process (the parent runs each in a fresh process)."""
    sys.path.insert(0, str(ROOT))
    from modules.config.loading import build_config
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer

    config = build_config([{
        "model": {"base": model, "parts": {"unet": {"weight_dtype": weights, "gradient_checkpointing": True}}},
        "method": {"type": "fine_tune", "fused_backward": fused},
        "concepts": [{"path": images}], "data": {"resolution": 128},
        "optimizer": {"type": optimizer, "lr": 1e-5},
        "schedule": {"epochs": 100, "max_steps": steps, "batch_size": 1},
        "workspace_dir": work, "output": {"path": f"{work}/out.safetensors"},
        "tensorboard": False, "train_device": "cpu",
    }])
    window = {"open": False, "peak": 0}

    class Window(TrainCallbacks):
        def on_progress(self, progress):
            window["open"] = progress.step >= 1  # steps 2..N

    def sample():
        while not window.get("done"):
            if window["open"]:
                window["peak"] = max(window["peak"], _rss())
            time.sleep(0.002)

    from diffusers import AutoencoderKL, UNet2DConditionModel  # noqa: F401  (imported before the baseline)
    from transformers import CLIPTextModel  # noqa: F401

    imports_only = _rss()
    trainer = GenericTrainer(config, Window())
    trainer.start()
    loaded = _rss()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    trainer.train()
    window["done"] = True
    sampler.join()
    trainer.release()
    mib = 1 << 20
    grads = sum(p.numel() * p.element_size() for p in trainer.trained_parameters())
    return {"optimizer": optimizer, "fused": fused, "weights": weights, "grads": round(grads / mib, 1),
            "loaded": round((loaded - imports_only) / mib, 1), "peak": round((window["peak"] - imports_only) / mib, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "adamw_8bit"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--weights", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a child process's own case (JSON)
    args = parser.parse_args()
    if args.case:
        print("RESULT " + json.dumps(measure(**json.loads(args.case))), flush=True)
        return
    from benchmarks.models import build_model, write_images

    work = Path(tempfile.mkdtemp(prefix="fine-tune-memory-"))
    model = build_model("small", work / "model")
    images = write_images(work / "images")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    results = []
    for optimizer in args.optimizers:
        for fused in (False, True):
            case = {"model": str(model), "images": str(images), "work": str(work / f"{optimizer}-{fused}"),
                    "optimizer": optimizer, "fused": fused, "steps": args.steps, "weights": args.weights}
            output = subprocess.run([sys.executable, "-m", "benchmarks.fine_tune_memory", "--case", json.dumps(case)],
                                    cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
            results.append(json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:]))
            print(json.dumps(results[-1]), flush=True)  # each case as it ends (a long run may be cut short)
    print(f"{'optimizer':<12}{'fused':<7}{'weights':<10}{'grads MiB':>10}{'loaded MiB':>12}{'peak MiB':>10}"
          f"{'peak/unfused':>14}")
    for result in results:
        unfused = next(r for r in results if r["optimizer"] == result["optimizer"] and not r["fused"])
        print(f"{result['optimizer']:<12}{str(result['fused']):<7}{result['weights']:<10}{result['grads']:>10}"
              f"{result['loaded']:>12}"
              f"{result['peak']:>10}{result['peak'] / unfused['peak']:>14.2f}")


if __name__ == "__main__":
    main()
