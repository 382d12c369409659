"""The GPU check: each part in its own process, with its own time budget, its result written into
report.json and report.md as soon as it ends (tools/gpu_check/run.sh is the entry point).

    python -m tools.gpu_check.runner --out DIR [--cpu-dry-run] [--total-s 450] [--only PART ...]

On the GPU each part runs in its own process: a part that hangs, crashes CUDA or runs out of
memory costs that part only, and each part's peak memory is its own. The CPU dry run runs the
parts in this process, one after the other (the imports once, not per part). The order puts what
is cheap and telling first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.gpu_check.report import Report

REPO = Path(__file__).resolve().parent.parent.parent
# (part, its seconds on a GPU); a part also gets what the parts before it left of theirs. Issue
# 25's figure (plan_vs_measured: two real-width folders written, planned and trained twice each)
# goes right after the quick checks, with the most time
PARTS = [
    ("environment", 10),
    ("torch_compat", 20),
    ("background_plan", 30),
    ("plan_vs_measured", 130),
    ("cuda_tests", 35),
    ("families", 50),
    ("weight_modes", 35),
    ("real_width", 60),
    ("compile_smoke", 30),
]
GPU_TOTAL_S = sum(seconds for _, seconds in PARTS)  # 400 s: with the wheels' install and a machine's start, ~8 minutes
DRY_RUN_BUDGET_S = 600  # a part's budget in the dry run: its sizes are the smallest, its time is the CPU's
RESERVE_S = 5  # for the report after the last part


def run_part(name: str, budget: float, work: Path) -> dict:
    """A part in its own process, stopped at its budget."""
    result_file, log_file = work / f"{name}.result.json", work / f"{name}.log"
    command = [sys.executable, "-m", "tools.gpu_check.part", name, "--size", "full",
               "--work", str(work / name), "--result", str(result_file), "--budget", str(budget)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    with open(log_file, "w") as log:
        try:
            subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           timeout=budget, check=False)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
    seconds = time.monotonic() - started
    if result_file.exists():
        result = json.loads(result_file.read_text())
    elif timed_out:
        partial = result_file.with_suffix(".partial.json")  # the cases it finished (part.py's save_partial)
        result = {"status": "timeout", "reason": f"still running after its budget of {budget:.0f} s",
                  **(json.loads(partial.read_text()) if partial.exists() else {})}
    else:
        result = {"status": "failed", "reason": "the part's process ended without a result (crashed)"}
    if result["status"] in ("failed", "timeout") and not result.get("error"):
        result["error"] = log_file.read_text()[-3000:]
    return {"name": name, **result, "seconds": seconds}


def run_part_here(name: str, budget: float, work: Path) -> dict:
    """The dry run's way: in this process (one set of imports for all parts; not stopped at its budget)."""
    from tools.gpu_check.part import run_named

    started = time.monotonic()
    result = run_named(name, "dry", work / name, budget)
    return {"name": name, **result, "seconds": time.monotonic() - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="where report.json, report.md and the logs go")
    parser.add_argument("--cpu-dry-run", action="store_true", help="every part at its smallest size, on the CPU")
    parser.add_argument("--total-s", type=float, help="the whole check's time (parts are cut to fit); default "
                        f"{GPU_TOTAL_S} s on the GPU; the dry run has no limit (a busy CPU must not fail it)")
    parser.add_argument("--only", nargs="*", help="run only these parts")
    parser.add_argument("--work", help="scratch space: models, workspaces, each part's log (default: a new "
                        "folder under the temp dir; --out then holds report.json and report.md alone)")
    args = parser.parse_args(argv)
    if args.cpu_dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU's, also on a machine with a GPU (before torch loads)
    total_s = args.total_s or (DRY_RUN_BUDGET_S * len(PARTS) if args.cpu_dry_run else GPU_TOTAL_S)
    out = Path(args.out)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="difftrainer-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report = Report(out, {"mode": "cpu-dry-run" if args.cpu_dry_run else "gpu",
                          "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "work": str(work)})
    planned_s = 0.0  # the budgets of the parts run so far: what they left unused goes to the next
    for name, full_s in PARTS:
        if args.only and name not in args.only:
            continue
        planned_s += full_s
        left = total_s - (time.monotonic() - started) - RESERVE_S
        budget = min(planned_s - (time.monotonic() - started), left)
        if budget < 5:
            report.add({"name": name, "status": "skipped", "reason": "no time left in the check's total", "seconds": 0})
            continue
        if args.cpu_dry_run:
            result = run_part_here(name, min(DRY_RUN_BUDGET_S, left), work)
        else:
            result = run_part(name, budget, work)
        if name == "environment":
            figures = result.get("figures", {})
            report.data.update(device=figures.get("device"), torch=figures.get("torch"), commit=figures.get("commit"))
        report.add(result)
        print(f"[gpu check] {name}: {result['status']} in {result['seconds']:.1f} s {result.get('reason', '')}",
              flush=True)
    report.finish(finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  seconds=round(time.monotonic() - started, 1))
    return 0 if all(p["status"] in ("passed", "skipped") for p in report.data["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
