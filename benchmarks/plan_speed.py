"""How long `launch.py plan` takes per built-in preset (issue 25: under 10 s each on the CPU), each
in its own process, as a user runs it: against the tier in the preset's name and 64 GiB of RAM
(as tools/preset_plans.py plans them; 64 GiB too for a preset without a tier, so no host's own RAM
sends a plan into the fixes' search).

  python -m benchmarks.plan_speed [--preset NAME ...] [--limit 10]

Prints per preset the wall seconds and the CPU seconds (user + system) of the process, and the
load average before and after: on a busy machine the wall time is the process's share of the
cores, the CPU time what it would take on an idle one. Exits 1 when a preset's CPU time is over
`--limit`. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def plan_command(name: str) -> list[str]:
    from tools.preset_plans import tier_of

    tier = tier_of(name)
    return [sys.executable, str(REPO / "launch.py"), "plan", "--preset", name,
            *(["--vram", f"{tier}GiB"] if tier else []), "--ram", "64GiB", "--json"]


def time_plan(name: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one `launch.py plan` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(plan_command(name), cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{name}: launch.py plan failed:\n{done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    from tools.preset_plans import builtin_presets

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", default=[], help="only these presets (repeatable)")
    parser.add_argument("--limit", type=float, default=10.0, help="CPU seconds a preset may take (default 10)")
    args = parser.parse_args()
    names = args.preset or builtin_presets()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '(unset)')}", flush=True)
    print(f"{'preset':34} {'wall s':>7} {'CPU s':>7}", flush=True)
    over = []
    for name in names:
        wall, cpu = time_plan(name)
        print(f"{name:34} {wall:7.1f} {cpu:7.1f}" + ("  over the limit" if cpu > args.limit else ""), flush=True)
        if cpu > args.limit:
            over.append(name)
    print(f"load average {os.getloadavg()[0]:.2f}; {len(names) - len(over)} of {len(names)} presets within "
          f"{args.limit:g} CPU s", flush=True)
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
