"""The plan of built-in presets with the step on meta tensors (what `launch.py plan` runs where no
activation offloading sends copies to the CPU) against the same plan with the step on fake tensors
(FakeTensorMode): they must be the same to the byte. tests/test_plan_meta_pass.py compares them on
tiny models; this compares them on the released architectures the presets are sized for.

  python -m benchmarks.plan_meta_vs_fake [--preset NAME ...]

Default: every built-in preset whose text encoders run in the step (an embedding; no text cache).
Prints per preset whether the two plans are equal and the CPU seconds of each; exits 1 on any
difference. A measurement, not a test (a fake plan of a 12B model takes 5-15 CPU s).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GiB = 2**30


def text_in_step_presets() -> list[str]:
    from modules.config.families import get_family_class
    from modules.plan.run_plan import text_in_step
    from tools.preset_plans import builtin_presets, preset_config

    names = []
    for name in builtin_presets():
        config = preset_config(name)
        if text_in_step(config, get_family_class(config.model.family)(config)):
            names.append(name)
    return names


def plan_both_ways(name: str) -> tuple[dict, float, dict, float]:
    """(plan on meta, its CPU s, plan on fake tensors, its CPU s), against the preset's tier as
    tools/preset_plans.py plans it."""
    from modules.config.families import get_family_class
    from modules.plan import fake_pass
    from modules.plan.run_plan import plan_run
    from tools.preset_plans import RAM_BUDGET, preset_config, tier_of

    config = preset_config(name)
    tier = tier_of(name)
    variant = get_family_class(config.model.family).released_variant(name)
    measure_step = fake_pass.measure_step
    results = []
    try:
        for fake in (False, True):
            fake_pass.measure_step = functools.partial(measure_step, fake=fake)
            started = time.process_time()
            plan = plan_run(config, tier * GiB if tier else None, RAM_BUDGET if tier else None, variant=variant)
            results += [plan.as_dict(), time.process_time() - started]
    finally:
        fake_pass.measure_step = measure_step
    return tuple(results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", default=[], help="only these presets (repeatable)")
    args = parser.parse_args()
    names = args.preset or text_in_step_presets()
    print(f"{'preset':36} {'plans':9} {'meta CPU s':>10} {'fake CPU s':>10}", flush=True)
    different = []
    for name in names:
        on_meta, meta_seconds, on_fake, fake_seconds = plan_both_ways(name)
        same = on_meta == on_fake
        if not same:
            different.append(name)
        print(f"{name:36} {'equal' if same else 'DIFFERENT':9} {meta_seconds:10.1f} {fake_seconds:10.1f}", flush=True)
    print(f"{len(names) - len(different)} of {len(names)} presets plan the same on meta and fake tensors", flush=True)
    return 1 if different else 0


if __name__ == "__main__":
    raise SystemExit(main())
