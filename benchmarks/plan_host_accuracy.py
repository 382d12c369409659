"""The plan's host figures against the host RAM a real run holds (issue 25): the planned load peak
and training peak (`launch.py plan --json`: host.load_peak, host.train_peak) beside the resident
memory the trainer's process grows by, for weight modes x offload_fraction {0, 0.5} x method
(adapter; fine-tune, fused backward) on the fake device (tests/fake_device.py), small (35M) or
tiny SD1.5 model (benchmarks/models.py), batch 2, two steps.

  python -m benchmarks.plan_host_accuracy [--sizes small] [--modes bfloat16 float8 int8] [--methods adapter fine-tune]

Each case runs in a fresh process (`--case`), so an earlier case's allocations cannot pollute it.
What is measured, on Linux (/proc/self/status; modules/util/memory.py):
- baseline: when the trainer says "loading model" (after the imports, the preflight, the workspace),
  after a collection and malloc_trim, with the kernel's peak counter reset (/proc/self/clear_refs);
- load: the peak resident size (VmHWM) when the parts go to the train device, over the baseline;
- training: the bytes of the host tensors alive after step 2 (each CPU storage reachable from
  Python once, collected first), over those at the baseline: what the plan's train_peak counts (a
  resting part's copies, the parked blocks' arenas, their optimizer state). Not the resident size:
  for the same case under load it read 11.5 to 51.8 MB (planned 29.1 MB; this count read 31.6), the
  allocator's counters (mallinfo2) a steady 42 MB. Whether a buffer lands in freed heap memory that
  is still resident or in a fresh mmap whose untouched pages are not depends on which thread freed
  what first; and the counters also hold what the fake device's CPU kernels keep (their caches),
  host memory only because the fake device computes on the host.
The fake device's memory is host memory here: its allocated bytes at each resident reading are taken off,
and from the move to the device on its tensors are mmaps of their own (freed activations would
leave the heap fragmented by tens of MB; on CUDA they are in the device's allocator). A warm-up
run of the same case on the tiny model first puts the run's lazy imports in the baseline.
Not measured: what glibc keeps cached beyond the trim, and CUDA's pinned-allocator slack.
Prints one row per case: planned, measured, planned/measured for the load and for training.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

METHODS = {
    "adapter": {},
    "fine-tune": {"method": {"type": "fine_tune", "fused_backward": True}},
}
# the host figures do not depend on the resolution (activations sit on the device): each model at the
# lowest its step stays cheap at (SD's buckets are 64 px at the least). `wide`: few blocks of many
# channels, 258 MB in float32 (143 MB in bfloat16, nearly all UNet), a step of little compute: the
# most bytes per second of run. Its VAE downsamples 8x, as SD's does (the tiny one's 2x gave 32x32
# latents at 64 px: 1024-token attention at 512 channels, most of a case's seconds)
WIDE = dict(unet=dict(sample_size=8, block_out_channels=(256, 512), layers_per_block=1,
                      transformer_layers_per_block=2, cross_attention_dim=512, attention_head_dim=8),
            text=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
                      projection_dim=512),
            vae=dict(block_out_channels=(32, 64, 64, 64), down_block_types=("DownEncoderBlock2D",) * 4,
                     up_block_types=("UpDecoderBlock2D",) * 4))
RESOLUTION = {"wide": 64, "small": 64, "tiny": 64}


def build_warm_up_model(out: Path) -> Path:
    """The model of each case's warm-up run (run_case): the tiny SD1.5 with the wide model's 8x VAE,
    whose two steps at 64 px take a fifth of the tiny VAE's (0.7 s of CPU against 4.0)."""
    from modules.model.sd15 import SD15Family

    return SD15Family.make_tiny_model(out, unet=dict(sample_size=8), vae=WIDE["vae"], seed=0)


def build_sized_model(size: str, out: Path) -> Path:
    from benchmarks.models import build_model

    if size != "wide":
        return build_model(size, out)
    from modules.model.sd15 import SD15Family

    return SD15Family.make_tiny_model(out, unet=WIDE["unet"], text=WIDE["text"], vae=WIDE["vae"], seed=0)


def cases(modes: list[str], methods: list[str], offloads: list[float] = (0.0, 0.5)):
    for method in methods:
        for mode in modes:
            if method != "adapter" and mode not in ("bfloat16", "float32"):
                continue  # a quantized part does not train its weights
            for offload in offloads:
                yield method, mode, offload


def case_config(model: Path, images: Path, work: Path, size: str, method: str, mode: str, offload: float,
                device: str = "fakegpu"):
    from modules.config.loading import build_config

    return build_config([{
        # checkpointing on: a trained part's parked blocks are recomputed (the config refuses it off)
        "model": {"base": str(model), "parts": {"unet": {"weight_dtype": mode, "offload_fraction": offload,
                                                          "gradient_checkpointing": True}}},
        "concepts": [{"path": str(images)}], "data": {"resolution": RESOLUTION[size]},
        "schedule": {"epochs": 1, "batch_size": 2, "max_steps": 2}, "train_device": device,
        "workspace_dir": str(work / "ws"), "output": {"path": str(work / "out.safetensors")},
        "tensorboard": False, "sampling": {"prompts": []}}, METHODS[method]])


# --- one case, in its own process ------------------------------------------------------------------

def _status() -> dict[str, int]:
    from modules.util.memory import process_memory

    return process_memory()


def _trimmed_host_bytes() -> int:
    """Resident bytes now, less the fake device's (its tensors are host memory), once the collector
    ran and glibc gave its free heap pages back (malloc_trim)."""
    import torch

    from modules.util.memory import return_freed_heap

    gc.collect()
    return_freed_heap()
    return _status()["rss"] - torch.get_device_module("fakegpu").memory_allocated()


def _host_tensor_bytes() -> int:
    """Bytes of the CPU storages that tensors reachable from Python hold now (a storage shared by
    views, as a pinned arena is, counted once), after a collection. The fake device's tensors are
    not on the CPU, so their memory is not in it."""
    import torch

    gc.collect()
    storages = {}
    for thing in gc.get_objects():
        if isinstance(thing, torch.Tensor) and thing.device.type == "cpu" and not thing.is_meta:
            storage = thing.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run_case(spec: dict) -> dict:
    """{"load": bytes, "train": bytes} the trainer's process grew by over its baseline."""
    sys.path.insert(0, str(REPO / "tests"))
    from fake_device import enable_fake_device

    enable_fake_device()
    import torch
    from torch import nn

    from modules.quantization.replace import is_quantized_mode, new_quantized_layer
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer

    if is_quantized_mode(spec["mode"]):  # the mode's layer classes and libraries, before the baseline
        new_quantized_layer(spec["mode"], nn.Linear(64, 64), torch.float32)
    figures: dict[str, int] = {}

    class Probe(TrainCallbacks):
        def on_status(self, text: str) -> None:
            if text == "loading model":
                figures["baseline"] = _trimmed_host_bytes()
                figures["tensors_at_baseline"] = _host_tensor_bytes()
                with open("/proc/self/clear_refs", "w") as refs:
                    refs.write("5")  # VmHWM := VmRSS: the peak from here on is the load's

        def on_memory(self, report: dict) -> None:  # after step 2 (modules/trainer/memory_report.py)
            figures["train"] = _host_tensor_bytes() - figures["tensors_at_baseline"]

    class MeasuredTrainer(GenericTrainer):
        def setup_train_device(self) -> None:
            # every part loaded, none moved yet: the load's peak (quantized layers may sit on the device)
            figures["load"] = _status()["peak_rss"] - torch.get_device_module("fakegpu").memory_allocated() - figures["baseline"]
            # the fake device's tensors are host allocations: served from the heap, a step's freed
            # activations leave it fragmented, tens of MB a trim cannot return (on CUDA they are in the
            # device's allocator); as mmaps of their own they go back whole when freed
            ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD
            super().setup_train_device()

    # a first run of the same case on the tiny model imports what the run imports lazily (~130 MB
    # by the load, ~200 MB more by step 2: diffusers' and transformers' classes, the optimizer ...),
    # so that the baseline holds them; what it allocated goes before the baseline is read
    for model, work, callbacks in ((spec["warm_model"], Path(spec["work"]) / "warm-up", TrainCallbacks()),
                                   (spec["model"], Path(spec["work"]), Probe())):
        config = case_config(Path(model), Path(spec["images"]), work, spec["size"], spec["method"], spec["mode"],
                             spec["offload"])
        trainer = MeasuredTrainer(config, callbacks) if isinstance(callbacks, Probe) else GenericTrainer(config, callbacks)
        trainer.start()
        trainer.train()
        assert trainer.step == 2, trainer.step
        trainer.release()
        del trainer
    return {"load": figures["load"], "train": figures["train"]}


def measure_in_fresh_process(spec: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "benchmarks.plan_host_accuracy", "--case", json.dumps(spec)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"case {spec}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def planned_host(model: Path, images: Path, work: Path, size: str, method: str, mode: str, offload: float,
                 device: str = "fakegpu") -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from fake_device import enable_fake_device

    from modules.plan.run_plan import plan_run

    enable_fake_device()
    return plan_run(case_config(model, images, work, size, method, mode, offload, device), None, None).host


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["wide"], choices=list(RESOLUTION))
    parser.add_argument("--modes", nargs="+", default=["float32", "bfloat16", "float8", "int8"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--offloads", nargs="+", type=float, default=[0.0, 0.5])
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case's JSON: run it here, print its figures
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return 0
    from benchmarks.models import write_images

    mib = 2**20
    print("| model | method | weights | offload | load planned / measured MiB | ratio "
          "| training planned / measured MiB | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        warm_model = build_warm_up_model(root / "model-warm-up")
        for size in args.sizes:
            model = build_sized_model(size, root / f"model-{size}")
            images = write_images(root / f"images-{size}", RESOLUTION[size])
            for number, (method, mode, offload) in enumerate(cases(args.modes, args.methods, args.offloads)):
                work = root / f"run-{size}-{number}"
                plan = planned_host(model, images, work, size, method, mode, offload)
                measured = measure_in_fresh_process({"model": str(model), "images": str(images), "work": str(work),
                                                     "warm_model": str(warm_model), "size": size, "method": method, "mode": mode,
                                                     "offload": offload})
                cells = []
                for planned, got in ((plan["load_peak"], measured["load"]), (plan["train_peak"], measured["train"])):
                    ratio = f"{planned / got:.3f}" if got > 0 else "-"
                    cells.append(f"{planned / mib:.1f} / {got / mib:.1f} | {ratio}")
                print(f"| {size} | {method} | {mode} | {offload:g} | {' | '.join(cells)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
