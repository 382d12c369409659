"""Release check: the trainer against the bare loop on every benchmark size; exit 1 when a goal is missed.

    python -m benchmarks.release_check [--work DIR] [--sizes tiny small] [--rounds 2]
                                       [--steps tiny=20 small=6] [--baseline REF] [--no-counts]

Goals, per size (docs/benchmarks.md):
- mean step time (steps 2..N) of the trainer <= 1.05x the bare loop's;
- peak RSS of the trainer within 5% of the bare loop's, either way: a peak well below the bare
  loop's means the step holds or frees memory differently (issue 19 showed as 0.66x);
- the same matmul/convolution/attention calls per step, no more bytes saved for backward, no more
  tensors alive as the backward pass begins (but the batches assembled ahead), no autograd graph
  left once the step has ended, and freed memory reused from step to step
  (benchmarks/step_work.py; counts, so a busy machine does not blur them);
- with --baseline REF (a git commit, e.g. f008a10, the foundation): the trainer's mean step
  <= 1.05x the trainer at REF, run by REF's own `benchmarks.run` in a temporary git worktree.

Wall times on a shared machine: each round runs every implementation once, one after the other,
in an order that rotates from round to round, and a ratio is taken within each round (neighbours
in time see similar load); the table shows the median of the rounds' figures and ratios. Each run
also reports the CPU other processes used meanwhile (`other CPU %`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.models import SIZES
from benchmarks.run import REPO, prepare, run_bare, run_trainer

DEFAULT_STEPS = {"tiny": 20, "small": 6}  # small: ~8 s a step on 2 idle cores; 5 timed steps give a stable mean
STEP_RATIO_GOAL = 1.05
RSS_BAND = 0.05
COLUMNS = [("mean_step_s", "mean s/step"), ("median_step_s", "median s/step"), ("min_step_s", "min s/step"),
           ("peak_rss_mb", "peak RSS MB"), ("other_cpu_pct", "other CPU %")]


def run_baseline(ref: str, size: str, work: Path, steps: int) -> dict:
    """The trainer at git commit `ref`, timed by that commit's own harness (same models and images)."""
    with tempfile.TemporaryDirectory(prefix="release-baseline-") as folder:
        tree = Path(folder) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), ref], check=True,
                       stdout=subprocess.DEVNULL)
        try:
            subprocess.run([sys.executable, "-m", "benchmarks.run", "--work", str(work), "--sizes", size,
                            "--only", "trainer", "--steps", str(steps)], cwd=tree, check=True,
                           stdout=subprocess.DEVNULL)
            return json.loads((work / "results.json").read_text())[size]["trainer"]
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)


def step_counts(size: str, work: Path) -> dict:
    model, images = prepare(size, work)
    spec = SIZES[size]
    done = subprocess.run([sys.executable, "-m", "benchmarks.step_work", "--model", str(model), "--images", str(images),
                           "--resolution", str(spec["resolution"]), "--batch", str(spec["batch"]), "--steps", "4"],
                          cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"benchmarks.step_work failed for {size}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_size(size: str, work: Path, steps: int, rounds: int, baseline: str | None) -> dict:
    runners = {"bare": lambda: run_bare(size, work, steps), "trainer": lambda: run_trainer(size, work, steps)}
    if baseline:
        runners["baseline"] = lambda: run_baseline(baseline, size, work, steps)
    names = list(runners)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for index in range(rounds):
        order = names[index % len(names):] + names[:index % len(names)]
        for name in order:
            print(f"[{size}] round {index + 1}/{rounds}: {name} ...", file=sys.stderr, flush=True)
            runs[name].append(runners[name]())
    return runs


def median_of(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs if run.get(key) is not None]
    return statistics.median(values) if values else None


def round_ratio(runs: dict[str, list[dict]], key: str, over: str) -> float | None:
    """Median over rounds of trainer[key] / over[key], each ratio within one round."""
    ratios = [t[key] / o[key] for t, o in zip(runs["trainer"], runs[over]) if t.get(key) and o.get(key)]
    return statistics.median(ratios) if ratios else None


def report(size: str, runs: dict[str, list[dict]], counts: dict | None) -> tuple[list[str], list[str]]:
    """Table rows for `size` and the goals it misses."""
    rows, missed = [], []
    for name, name_runs in runs.items():
        cells = "".join(f"{median_of(name_runs, key):>15.3f}" if median_of(name_runs, key) is not None
                        else f"{'-':>15}" for key, _ in COLUMNS)
        rows.append(f"{size:<6} {name:<17}{cells}")
    for over in [name for name in runs if name != "trainer"]:
        cells = "".join(f"{round_ratio(runs, key, over):>15.3f}" if key != "other_cpu_pct" and
                        round_ratio(runs, key, over) is not None else f"{'-':>15}" for key, _ in COLUMNS)
        rows.append(f"{size:<6} {'trainer/' + over:<17}{cells}")
    step = round_ratio(runs, "mean_step_s", "bare")
    if step is None or step > STEP_RATIO_GOAL:
        missed.append(f"{size}: mean step trainer/bare {step} > {STEP_RATIO_GOAL}")
    rss = round_ratio(runs, "peak_rss_mb", "bare")
    if rss is None or abs(rss - 1) > RSS_BAND:
        missed.append(f"{size}: peak RSS trainer/bare {rss} outside 1 +- {RSS_BAND}")
    if "baseline" in runs:
        base = round_ratio(runs, "mean_step_s", "baseline")
        if base is None or base > STEP_RATIO_GOAL:
            missed.append(f"{size}: mean step trainer/baseline {base} > {STEP_RATIO_GOAL}")
    if counts is not None:
        from benchmarks.step_work import differences

        bare, trainer = counts["bare"], counts["trainer"]
        rows.append(f"{size:<6} step work: heavy ops trainer {sum(trainer['heavy_ops'].values())} / bare "
                    f"{sum(bare['heavy_ops'].values())}, saved for backward {trainer['saved_bytes'] / 2**20:.1f} / "
                    f"{bare['saved_bytes'] / 2**20:.1f} MiB, held as backward begins {trainer['held_bytes'] / 2**20:.2f} / "
                    f"{bare['held_bytes'] / 2**20:.2f} MiB, graph nodes after the step "
                    f"{trainer['graph_nodes_after_step']} / {bare['graph_nodes_after_step']}, refill faults "
                    f"{trainer['reuse_faults']} / {bare['reuse_faults']}")
        missed += [f"{size}: {problem}" for problem in differences(counts)]
    return rows, missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/trainer-bench"), help="cache and log folder")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", nargs="*", default=[], metavar="SIZE=N",
                        help="steps per run, per size (default: " +
                             " ".join(f"{k}={v}" for k, v in DEFAULT_STEPS.items()) + ")")
    parser.add_argument("--baseline", metavar="REF", help="also time the trainer at this git commit")
    parser.add_argument("--no-counts", action="store_true", help="skip the step-work counts")
    args = parser.parse_args()
    steps = dict(DEFAULT_STEPS)
    for item in args.steps:
        size, _, value = item.partition("=")
        if size not in SIZES or not value.isdigit() or int(value) < 3:
            parser.error(f"--steps: {item!r} is not SIZE=N with a known size and N >= 3")
        steps[size] = int(value)
    work = args.work.resolve()

    header = f"{'size':<6} {'impl':<17}" + "".join(f"{title:>15}" for _, title in COLUMNS)
    rows, missed, everything = [header, "-" * len(header)], [], {}
    for size in args.sizes:
        runs = check_size(size, work, steps[size], args.rounds, args.baseline)
        counts = None if args.no_counts else step_counts(size, work)
        size_rows, size_missed = report(size, runs, counts)
        rows += size_rows
        missed += size_missed
        everything[size] = {"runs": runs, "counts": counts}
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    (work / "release_check.json").write_text(json.dumps({"commit": commit, "dirty": bool(dirty), "steps": steps,
                                                         "rounds": args.rounds, "sizes": everything}, indent=1))
    print(f"commit {commit}{' (with uncommitted changes)' if dirty else ''}; rounds {args.rounds}; steps "
          + ", ".join(f"{s}={steps[s]}" for s in args.sizes) + "; ratios: median over rounds of within-round ratios")
    print("\n".join(rows))
    print(f"\nfull results: {work / 'release_check.json'}")
    if missed:
        print("\nMISSED:\n" + "\n".join(f"- {m}" for m in missed))
        sys.exit(1)
    print("\nall goals met")


if __name__ == "__main__":
    main()
