"""Where in a run the trainer's peak RSS falls: its RSS sampled every 0.1 s beside the run's own
status lines and progress events (load, caching, each step).

    python -m benchmarks.rss_timeline [--work DIR] [--size small] [--steps 3]

Same model, images and settings as `benchmarks.run`'s trainer. Linux only (reads /proc). Written
for issue 19's question: on `small` the trainer's peak was ~10% over the bare loop's with equal
step work, and fell in step 2, not step 1 (the step's autograd graph kept into the next step;
fixed at 138d817, see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.models import SIZES
from benchmarks.run import REPO, prepare, trainer_config


def rss_mb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))
    except (OSError, StopIteration):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("workspace/benchmarks"))
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    model, images = prepare(args.size, args.work)
    workspace = args.work / args.size / "rss-timeline-workspace"
    shutil.rmtree(workspace, ignore_errors=True)
    spec = SIZES[args.size]
    config = {**trainer_config(model, images, workspace, args.steps, spec["resolution"], spec["batch"]),
              "tensorboard": False}
    config_file = args.work / args.size / "rss-timeline.json"
    config_file.write_text(json.dumps(config))

    start = time.monotonic()
    run = subprocess.Popen([sys.executable, "launch.py", "train", "--protocol", "jsonl", "--config", str(config_file)],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marks: list[tuple[float, str]] = []  # (seconds, what the run said)

    def read(stream) -> None:
        for line in stream:
            line = line.strip()
            if line.startswith("[") or '"progress"' in line:  # status lines and progress events
                marks.append((time.monotonic() - start, line[:100]))

    readers = [threading.Thread(target=read, args=(s,), daemon=True) for s in (run.stdout, run.stderr)]
    for reader in readers:
        reader.start()
    samples: list[tuple[float, int]] = []
    while run.poll() is None:
        rss = rss_mb(run.pid)
        if rss is not None:
            samples.append((time.monotonic() - start, rss))
        time.sleep(0.1)
    for reader in readers:
        reader.join(timeout=5)
    if run.returncode != 0 or not samples:
        sys.exit(f"the run failed (exit {run.returncode})")
    # the peak between one mark and the next: what each phase (load, caching, step N) reaches
    bounds = [0.0, *(t for t, _ in sorted(marks)), samples[-1][0] + 1]
    labels = ["(start)", *(text for _, text in sorted(marks))]
    print(f"{'from s':>7} {'peak MB':>8}  phase (starts with)")
    for index, label in enumerate(labels):
        inside = [rss for t, rss in samples if bounds[index] <= t < bounds[index + 1]]
        if inside:
            print(f"{bounds[index]:7.1f} {max(inside):8d}  {label}")
    peak_time, peak = max(samples, key=lambda s: s[1])
    print(f"peak {peak} MB at {peak_time:.1f} s")


if __name__ == "__main__":
    main()
