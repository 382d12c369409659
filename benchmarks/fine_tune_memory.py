"""Peak memory of a full fine-tune of the `small` benchmark UNet (~35M parameters), with and
without the fused backward, per optimizer (issue 16's goal: gradient memory gone, <= 0.6x peak at
AdamW8bit).

Each case runs the real trainer in its own process on the CPU. Memory is the process's resident
set less its file-backed pages (library code), sampled every 2 ms from /proc/self/statm, with glibc told to serve every allocation above
64 KiB by mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once and it
follows live tensor memory. Reported per case, in MiB:
- `loaded`: after start() (model, data cache) minus before it (imports only),
- `peak`: the highest resident set in training steps 2..N minus the same imports-only baseline
  (step 1 is left out: the first-step guard holds a copy of the trained weights then, in every case),
- `peak/unfused`: that peak over the unfused peak with the same optimizer,
- `grads`: the size of all UNet gradients (what the fused backward should save),
- `state`: the optimizer state after training (measured: every state tensor once),
- `rest`: peak - loaded - state - grads (unfused) or - nothing (fused): whatever else training
  holds (activations, step temporaries, kernel caches), which the fused step does not touch,
- `best`: the ratio the fused run could reach with no activations at all,
  (loaded + state) / (loaded + grads + state): the ceiling the 0.6x goal is measured against.
The UNet trains with gradient checkpointing at batch 1 (as a large fine-tune would). `--weights
bfloat16` is how the presets store weights (UNet and text encoder bfloat16, train_dtype bfloat16,
VAE float32); `--train-dtype bfloat16` with float32 weights is float32 master weights under
bfloat16 autocast. `--resolution` (default 64: 32x32 latents; at 128 px this UNet has SD1.5's
latent size at 512 px with 25x fewer weights, so activations would set its peak).

    python -m benchmarks.fine_tune_memory                       # adamw and adamw_8bit, fp32 weights
    python -m benchmarks.fine_tune_memory --optimizers adamw_8bit --weights bfloat16   # as the presets
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
    """Resident memory that is not file-backed: tensors, heap, stacks. The code pages of torch's and
    bitsandbytes' libraries that the first backward pass and optimizer step touch (40-50 MiB
    here) are file-backed resident memory too; they are no training state and no GPU memory,
    so they are left out (statm: resident - shared)."""
    with open("/proc/self/statm") as statm:
        fields = statm.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


def state_bytes(optimizer) -> int:
    """Every optimizer state tensor once (an 8-bit optimizer's quantization maps are shared)."""
    seen = {}
    for state in optimizer.state.values():
        for value in state.values():
            if hasattr(value, "data_ptr") and value.numel():
                seen[value.data_ptr()] = value.numel() * value.element_size()
    return sum(seen.values())


def measure(model: str, images: str, work: str, optimizer: str, fused: bool, steps: int, weights: str,
            resolution: int = 64, train_dtype: str | None = None) -> dict:
    """One case, in this process (the parent runs each in a fresh process)."""
    sys.path.insert(0, str(ROOT))
    from modules.config.loading import build_config
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer

    config = build_config([{
        # bfloat16: as the presets store weights (the frozen text encoder too) and compute
        "model": {"base": model, "parts": {"unet": {"weight_dtype": weights, "gradient_checkpointing": True},
                                           "text_encoder": {"weight_dtype": weights}}},
        "train_dtype": train_dtype or weights,
        "method": {"type": "fine_tune", "fused_backward": fused},
        "concepts": [{"path": images}], "data": {"resolution": resolution},
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
    state = state_bytes(trainer.optimizer)
    return {"optimizer": optimizer, "fused": fused, "weights": weights, "train_dtype": train_dtype or weights,
            "resolution": resolution,
            "grads": round(grads / mib, 1), "state": round(state / mib, 1),
            "loaded": round((loaded - imports_only) / mib, 1), "peak": round((window["peak"] - imports_only) / mib, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "adamw_8bit"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--weights", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--train-dtype", choices=["float32", "bfloat16"], help="autocast dtype (default: the weights')")
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
                    "optimizer": optimizer, "fused": fused, "steps": args.steps, "weights": args.weights,
                    "resolution": args.resolution, "train_dtype": args.train_dtype}
            output = subprocess.run([sys.executable, "-m", "benchmarks.fine_tune_memory", "--case", json.dumps(case)],
                                    cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
            results.append(json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:]))
            print(json.dumps(results[-1]), flush=True)  # each case as it ends (a long run may be cut short)
    print(f"{'optimizer':<12}{'fused':<7}{'weights':<10}{'px':>5}{'grads':>8}{'state':>8}{'loaded':>8}{'peak':>8}"
          f"{'rest':>8}{'peak/unfused':>14}{'best':>6}  (MiB)")
    for r in results:
        unfused = next(u for u in results if u["optimizer"] == r["optimizer"] and not u["fused"])
        rest = r["peak"] - r["loaded"] - r["state"] - (0 if r["fused"] else r["grads"])
        best = (r["loaded"] + r["state"]) / (r["loaded"] + r["grads"] + r["state"])
        print(f"{r['optimizer']:<12}{str(r['fused']):<7}{r['weights']:<10}{r['resolution']:>5}{r['grads']:>8}"
              f"{r['state']:>8}{r['loaded']:>8}{r['peak']:>8}{rest:>8.1f}{r['peak'] / unfused['peak']:>14.2f}"
              f"{best:>6.2f}")


if __name__ == "__main__":
    main()
