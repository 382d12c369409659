"""Benchmarks of the data pipeline (issue 18), on the tiny SD1.5 model, CPU:

    python -m benchmarks.data_pipeline rss [--counts 100 5000] [--steps 625]
    python -m benchmarks.data_pipeline cache-build [--images 400] [--size 128]
    python -m benchmarks.data_pipeline step [--images 400] [--steps 150]

rss:          peak RSS of `launch.py train` on a prebuilt cache (`launch.py cache` first, not
              measured) with N unique images, the same number of steps for each N. Goal: 5,000
              images <= 1.1x the peak of 100.
cache-build:  images/s of the trainer's cache build (`prepare_dataset` on an empty cache: scan,
              hash, decode, encode, write) against a bare loop that decodes the same images and
              runs the same VAE in the same batches, writing nothing. Goal: >= 0.9x.
step:         median step time with background loading (data.prefetch_batches 2), with batches
              assembled between steps (0), and with every batch collated in memory before the
              run ("preloaded"). The cache is read from disk for every batch (data.cache_memory_mb
              0) so the loading has work to hide. Goal: background <= 1.02x preloaded.

Wall times on a shared machine are only comparable when it is quiet: each command prints the
1-minute load average before it runs. Work files go to --work (default /tmp/trainer-bench-data).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def load_average() -> float:
    return os.getloadavg()[0]


def tiny_model(work: Path) -> Path:
    folder = work / "tiny-sd15"
    if not (folder / "model_index.json").exists():
        from modules.model.sd15 import SD15Family

        SD15Family.make_tiny_model(folder)  # the tests' tiny model (tests/conftest.py)
    return folder


def unique_images(work: Path, count: int, size: int = 64) -> Path:
    """`count` captioned shape images, each with its own pixels (index-coded corner pixels) and its
    own caption, so no two share a cache entry."""
    from modules.data.synthetic_images import COLORS, SHAPES, draw_shape

    folder = work / f"images-{count}-{size}"
    if (folder / "done").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    names = list(COLORS)
    for index in range(count):
        color, background = names[index % len(names)], names[(index // len(names) + 1 + index) % len(names)]
        image = draw_shape(SHAPES[index % 3], color, background, size, size)
        image.putpixel((0, 0), (index & 255, (index >> 8) & 255, 7))
        image.save(folder / f"{index:05d}.png")
        (folder / f"{index:05d}.txt").write_text(f"a {color} {SHAPES[index % 3]}, number {index}", encoding="utf-8")
    (folder / "done").write_text("")
    return folder


def config_dict(model: Path, images: Path, workspace: Path, steps: int, batch: int, **data) -> dict:
    return {
        "model": {"base": str(model)},
        "concepts": [{"path": str(images)}],
        "data": {"resolution": 64, **data},
        "adapter": {"rank": 4, "alpha": 4},
        "schedule": {"epochs": 10_000, "max_steps": steps, "batch_size": batch},
        "workspace_dir": str(workspace),
        "output": {"path": str(workspace / "lora.safetensors"), "dtype": "float32"},
        "tensorboard": False,
        "train_device": "cpu",
        "seed": 0,
    }


# --- rss -------------------------------------------------------------------------------------------

def bench_rss(work: Path, counts: list[int], steps: int, batch: int) -> dict:
    from benchmarks.run import timed_run

    model, results = tiny_model(work), {}
    for count in counts:
        images = unique_images(work, count)
        workspace = work / f"rss-{count}"
        shutil.rmtree(workspace, ignore_errors=True)
        config = work / f"rss-{count}.json"
        config.write_text(json.dumps(config_dict(model, images, workspace, steps, batch)))
        timed_run([sys.executable, "launch.py", "cache", "--config", str(config)], work / "logs" / f"cache-{count}.log")
        load = load_average()
        run = timed_run([sys.executable, "launch.py", "train", "--config", str(config)],
                        work / "logs" / f"rss-{count}.log")
        results[count] = {"peak_rss_mb": round(run.peak_rss_mb, 1), "wall_s": round(time.time() - run.t0, 1),
                          "load_before": round(load, 2), "other_cpu_pct": round(run.other_cpu_pct, 1)}
        print(count, results[count], flush=True)
    first, last = counts[0], counts[-1]
    results["ratio"] = round(results[last]["peak_rss_mb"] / results[first]["peak_rss_mb"], 3)
    return results


# --- cache build -----------------------------------------------------------------------------------

def bench_cache_build(work: Path, count: int, size: int, repeats: int) -> dict:
    import torch
    from PIL import Image

    from modules.config.loading import build_config
    from modules.data.cache_build import ENCODE_BATCH
    from modules.data.dataset import prepare_dataset
    from modules.model.sd15 import SD15Family

    model, images = tiny_model(work), unique_images(work, count, size)
    config = build_config([config_dict(model, images, work / "build-ws", 1, 2, resolution=size,
                                       aspect_buckets=False)])
    family = SD15Family(config)
    family.load()
    device = torch.device("cpu")
    vae = family.parts["vae"]
    paths = sorted(images.glob("*.png"))

    @torch.no_grad()
    def bare() -> float:
        started = time.perf_counter()
        for start in range(0, len(paths), ENCODE_BATCH):
            pixels = []
            for path in paths[start:start + ENCODE_BATCH]:
                with Image.open(path) as opened:
                    array = torch.frombuffer(bytearray(opened.convert("RGB").tobytes()), dtype=torch.uint8)
                pixels.append(array.view(size, size, 3).permute(2, 0, 1).float() / 127.5 - 1)
            latents = vae.encode(torch.stack(pixels).to(device)).latent_dist.mean * vae.config.scaling_factor
            latents.cpu()
        return len(paths) / (time.perf_counter() - started)

    def trainer() -> float:
        cache = work / "build-cache"
        shutil.rmtree(cache, ignore_errors=True)
        started = time.perf_counter()
        dataset = prepare_dataset(config, family, device, cache, print, cache_text=False)
        assert dataset.cache_stats["latents"][1] == len(paths)
        return len(paths) / (time.perf_counter() - started)

    runs = {"bare": [], "trainer": []}
    load = load_average()
    for _ in range(repeats):  # interleaved, so a burst of load elsewhere hits both
        runs["bare"].append(bare())
        runs["trainer"].append(trainer())
    best = {name: max(rates) for name, rates in runs.items()}
    return {"images": len(paths), "size": size, "batch": ENCODE_BATCH, "torch_threads": torch.get_num_threads(),
            "bare_images_per_s": [round(r, 1) for r in runs["bare"]],
            "trainer_images_per_s": [round(r, 1) for r in runs["trainer"]],
            "ratio_best": round(best["trainer"] / best["bare"], 3), "load_before": round(load, 2)}


# --- step time -------------------------------------------------------------------------------------

class _Preloaded:
    """Every batch of the run collated before it starts: the step time without any data work."""

    def __init__(self, dataset, device, epochs: int):
        self.batches = {(epoch, position): dataset.collate(indices, device, epoch, position)
                        for epoch in range(epochs) for position, indices in enumerate(dataset.epoch_batches(epoch))}

    def collate(self, indices, device, epoch=0, batch_index=0):
        return self.batches[(epoch, batch_index)]

    def close(self):
        pass


def bench_step(work: Path, count: int, steps: int, batch: int, rounds: int) -> dict:
    from modules.config.loading import build_config
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer

    model, images = tiny_model(work), unique_images(work, count)

    class Times(TrainCallbacks):
        def __init__(self):
            self.arrivals = []

        def on_progress(self, progress):
            self.arrivals.append(time.perf_counter())

    def run(mode: str) -> float:
        workspace = work / f"step-{mode}"
        shutil.rmtree(workspace, ignore_errors=True)
        prefetch = 2 if mode == "background" else 0
        config = build_config([config_dict(model, images, workspace, steps, batch, prefetch_batches=prefetch,
                                           cache_memory_mb=0), {"cache_dir": str(work / "step-cache")}])
        times = Times()
        trainer = GenericTrainer(config, times)
        try:
            trainer.start()
            if mode == "synchronous":  # the data work per batch that background loading has to hide
                batches = trainer.dataset.epoch_batches(0)[:20]
                started = time.perf_counter()
                for position, indices in enumerate(batches):
                    trainer.dataset.collate(indices, trainer.device, 0, position)
                data_s.append((time.perf_counter() - started) / len(batches))
            if mode == "preloaded":
                epochs = -(-steps // trainer.steps_per_epoch) + 1
                trainer.batches = _Preloaded(trainer.dataset, trainer.device, epochs)
            trainer.train()
        finally:
            trainer.release()
        gaps = [b - a for a, b in zip(times.arrivals[5:], times.arrivals[6:])]  # after the first steps' warm-up
        return statistics.median(gaps)

    load, data_s = load_average(), []
    medians = {"background": [], "synchronous": [], "preloaded": []}
    for _ in range(rounds):
        for mode in medians:
            medians[mode].append(run(mode))
    best = {mode: min(values) for mode, values in medians.items()}
    return {"images": count, "batch": batch, "steps": steps,
            "median_step_ms": {mode: [round(v * 1000, 2) for v in values] for mode, values in medians.items()},
            "collate_ms_per_batch": round(statistics.median(data_s) * 1000, 2),
            "background_vs_preloaded": round(best["background"] / best["preloaded"], 3),
            "synchronous_vs_preloaded": round(best["synchronous"] / best["preloaded"], 3),
            "load_before": round(load, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["rss", "cache-build", "step"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/trainer-bench-data"))
    parser.add_argument("--counts", type=int, nargs="+", default=[100, 5000])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"load average (1 min) before: {load_average():.2f} on {os.cpu_count()} CPUs", flush=True)
    if args.what == "rss":
        result = bench_rss(args.work, args.counts, args.steps or -(-max(args.counts) // args.batch), args.batch)
    elif args.what == "cache-build":
        result = bench_cache_build(args.work, args.images, args.size, args.repeats)
    else:
        result = bench_step(args.work, args.images, args.steps or 150, args.batch, args.repeats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
