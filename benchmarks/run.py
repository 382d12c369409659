"""Benchmark harness: the bare loop vs. the trainer, per model size, on the same settings.

    python -m benchmarks.run [--work DIR] [--sizes tiny small] [--only bare|trainer] [--steps 40]

Each implementation runs in its own process (so imports, loading and caching count, as for a
user) under GNU time for its peak RSS. Models and images are built once and cached under --work.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.models import SIZES

REPO = Path(__file__).resolve().parent.parent
GNU_TIME = "/usr/bin/time"
RSS_LINE = "Maximum resident set size (kbytes):"

# Fallback when GNU time is missing: a tiny parent whose only child is the benchmark, so its
# RUSAGE_CHILDREN peak is that child's alone; written in GNU time's format so one parser reads both.
_RSS_WRAPPER = (
    "import resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[2:])\n"
    f"open(sys.argv[1], 'w').write('{RSS_LINE} %d\\n' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(code)\n"
)


@dataclass
class RunResult:
    t0: float  # time.time() just before the spawn
    lines: list[tuple[float, str]] = field(default_factory=list)  # (arrival time.time(), stdout line)
    peak_rss_mb: float | None = None
    other_cpu_pct: float = 0.0  # CPU used by processes other than this run, % of all cores
    returncode: int = 0


def have_gnu_time() -> bool:
    if Path(GNU_TIME).exists():
        return True
    if shutil.which("apt-get") and os.geteuid() == 0:
        print("installing GNU time (apt-get install -y time)", file=sys.stderr)
        subprocess.run(["apt-get", "install", "-y", "time"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return Path(GNU_TIME).exists()


def busy_cpu_s() -> float:
    """CPU seconds all cores have been busy since boot (/proc/stat: total minus idle and iowait)."""
    # user nice system idle iowait irq softirq steal; the guest fields after them repeat user/nice.
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process plus its finished children (the benchmark and its wrapper)."""
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage,
                                                  (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


def other_cpu_pct(start: tuple[float, float, float]) -> float:
    """Busy CPU not spent by us since `start` = (time, busy_cpu_s, own_cpu_s), as % of all cores:
    the machine is shared, and other work there inflates wall times (OpenMP threads that lose
    their core also spin, so even our CPU time is no clean measure)."""
    wall = time.time() - start[0]
    other = (busy_cpu_s() - start[1]) - (own_cpu_s() - start[2])
    return max(0.0, 100 * other / (wall * os.cpu_count()))


def cpu_snapshot() -> tuple[float, float, float]:
    return time.time(), busy_cpu_s(), own_cpu_s()


def timed_run(cmd: list[str], log: Path) -> RunResult:
    """Run `cmd` (any "{t0}" in it becomes the spawn time), timestamp each stdout line as it
    arrives, send stderr to `log`, and measure the peak RSS of the process tree's largest process."""
    log.parent.mkdir(parents=True, exist_ok=True)
    rss_file = log.with_suffix(".rss")
    rss_file.unlink(missing_ok=True)
    if have_gnu_time():
        prefix = [GNU_TIME, "-v", "-o", str(rss_file)]
    else:
        prefix = [sys.executable, "-c", _RSS_WRAPPER, str(rss_file)]
    idle_check = cpu_snapshot()
    time.sleep(0.5)
    if (busy := other_cpu_pct(idle_check)) > 20:
        print(f"warning: other processes use {busy:.0f}% of the CPUs; wall times will be inflated", file=sys.stderr)
    start = cpu_snapshot()
    t0 = time.time()
    result = RunResult(t0=t0)
    with open(log, "w") as err, subprocess.Popen(
        prefix + [part.replace("{t0}", repr(t0)) for part in cmd], cwd=REPO, stdout=subprocess.PIPE,
        stderr=err, text=True,
    ) as process:
        for line in process.stdout:
            result.lines.append((time.time(), line.rstrip("\n")))
    result.returncode = process.returncode
    result.other_cpu_pct = other_cpu_pct(start)
    for line in rss_file.read_text().splitlines() if rss_file.exists() else []:
        if line.strip().startswith(RSS_LINE):
            result.peak_rss_mb = int(line.split(":")[1]) / 1024  # ru_maxrss is in KiB on Linux
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {result.returncode}; see {log}")
    return result


def prepare(size: str, work: Path) -> tuple[Path, Path]:
    """Build (once) the model for `size` and the shared images; return their folders."""
    model, images = work / size / "model", work / "images"
    if not (model / "model_index.json").exists():
        subprocess.run([sys.executable, "-m", "benchmarks.models", "--size", size, "--out", str(model)],
                       cwd=REPO, check=True)
    if len(list(images.glob("*.png"))) < 8:
        subprocess.run([sys.executable, "-m", "benchmarks.models", "--images", str(images)], cwd=REPO, check=True)
    return model, images


def run_bare(size: str, work: Path, steps: int) -> dict:
    model, images = prepare(size, work)
    spec = SIZES[size]
    cmd = [sys.executable, "-m", "benchmarks.bare_loop", "--model", str(model), "--images", str(images),
           "--resolution", str(spec["resolution"]), "--steps", str(steps), "--batch", str(spec["batch"]),
           "--t0", "{t0}"]
    run = timed_run(cmd, work / "logs" / f"{size}-bare.log")
    stats = json.loads(next(line for _, line in reversed(run.lines) if line.startswith("{")))
    return dict(stats, peak_rss_mb=run.peak_rss_mb, other_cpu_pct=run.other_cpu_pct)


def trainer_config(model: Path, images: Path, workspace: Path, steps: int, resolution: int, batch: int) -> dict:
    """The bare loop's settings as a trainer config (see README for the list)."""
    return {
        "model": {"base": str(model)},
        "concepts": [{"path": str(images)}],
        "data": {"resolution": resolution},
        "adapter": {"rank": 16, "alpha": 16, "layer_filter": [r"^unet\..*(to_q|to_k|to_v|to_out|ff\.net)"]},
        "optimizer": {"type": "adamw", "lr": 3e-4, "weight_decay": 0.01},
        "schedule": {"epochs": 1000, "max_steps": steps, "batch_size": batch, "max_grad_norm": 1.0},
        "workspace_dir": str(workspace),
        "output": {"path": str(workspace / "lora.safetensors"), "dtype": "float32"},
        "train_device": "cpu",
        "seed": 0,
    }


def run_trainer(size: str, work: Path, steps: int = 40) -> dict:
    """`launch.py train --protocol jsonl` on the same model, images and settings; step times are
    the gaps between the arrivals of its `progress` events. The workspace (and so the cache) is
    emptied first, so encoding counts as it does for the bare loop."""
    model, images = prepare(size, work)
    workspace = work / size / "trainer-workspace"
    shutil.rmtree(workspace, ignore_errors=True)
    config = work / size / "trainer.json"
    spec = SIZES[size]
    config.write_text(json.dumps(trainer_config(model, images, workspace, steps, spec["resolution"], spec["batch"]),
                                 indent=1))
    run = timed_run([sys.executable, "launch.py", "train", "--config", str(config), "--protocol", "jsonl"],
                    work / "logs" / f"{size}-trainer.log")
    arrivals, losses = [], []
    for arrival, line in run.lines:
        event = json.loads(line)
        if event["event"] == "progress":
            arrivals.append(arrival)
            losses.append(event["loss"])
    later = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {
        "steps": [round(d, 5) for d in later],
        "first_step_end_s": round(arrivals[0] - run.t0, 4),
        "median_step_s": round(statistics.median(later), 5),
        "mean_step_s": round(statistics.fmean(later), 5),
        "min_step_s": round(min(later), 5),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "peak_rss_mb": run.peak_rss_mb,
        "other_cpu_pct": run.other_cpu_pct,
    }


COLUMNS = [("median_step_s", "median s/step"), ("mean_step_s", "mean s/step"), ("min_step_s", "min s/step"),
           ("first_step_end_s", "first step s"), ("peak_rss_mb", "peak RSS MB"),
           ("other_cpu_pct", "other CPU %")]  # the last is a caveat (a busy box), not a result: no ratio


def table(results: dict[str, dict[str, dict]]) -> str:
    header = f"{'size':<6} {'impl':<14}" + "".join(f"{title:>15}" for _, title in COLUMNS)
    rows = [header, "-" * len(header)]

    def row(size, impl, values):
        cells = "".join(f"{values[key]:>15.3f}" if values.get(key) is not None else f"{'-':>15}"
                        for key, _ in COLUMNS)
        rows.append(f"{size:<6} {impl:<14}{cells}")

    for size, impls in results.items():
        for impl, stats in impls.items():
            row(size, impl, stats)
        if "bare" in impls and "trainer" in impls:
            bare, trainer = impls["bare"], impls["trainer"]
            row(size, "trainer/bare", {key: trainer[key] / bare[key] for key, _ in COLUMNS[:-1]
                                        if trainer.get(key) and bare.get(key)})
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/trainer-bench"), help="cache and log folder")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--only", choices=["bare", "trainer"], help="run one implementation only")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    work = args.work.resolve()

    results: dict[str, dict[str, dict]] = {}
    for size in args.sizes:
        results[size] = {}
        if args.only != "trainer":
            print(f"[{size}] bare loop ...", file=sys.stderr)
            results[size]["bare"] = run_bare(size, work, args.steps)
        if args.only != "bare":
            print(f"[{size}] trainer ...", file=sys.stderr)
            results[size]["trainer"] = run_trainer(size, work, args.steps)

    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"\nfull results (per-step times, losses): {work / 'results.json'}; logs: {work / 'logs'}")


if __name__ == "__main__":
    main()
