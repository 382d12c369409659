"""Every built-in preset's plan on its family's released architecture, and how long planning took.

    python -m benchmarks.plan_presets [--preset NAME ...] [--gpu CLASS]

Each preset is planned against the VRAM its name says ("16GB": 16 GiB; none: no verdict) and 64 GiB
of RAM, in one process (the first plan also pays the imports: its time is given with and
without them). Columns: planned train-device peak, host peak, estimated seconds per step on the
GPU class (not measured on a GPU), the verdict and the plan's wall time.
"""

from __future__ import annotations

import argparse
import re
import time

GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", default=[], help="only these presets (repeatable)")
    parser.add_argument("--gpu", default=None, help="GPU class for seconds per step (default rtx4090)")
    args = parser.parse_args()
    started = time.perf_counter()
    from modules.cli.train_command import resolve_config
    from modules.config.families import get_family_class
    from modules.config.presets import list_presets
    from modules.plan.run_plan import plan_run
    from modules.util.library_logs import quiet_library_logs

    quiet_library_logs()
    imports = time.perf_counter() - started
    print(f"imports {imports:.1f} s")
    print(f"{'preset':34} {'family':10} {'peak GiB':>9} {'budget':>7} {'host GiB':>9} {'s/step':>7} {'verdict':>12} {'plan s':>7}")
    for preset in list_presets():
        if not preset.builtin or (args.preset and preset.name not in args.preset):
            continue
        config = resolve_config([], preset.name, [])
        tier = re.search(r"(\d+)GB", preset.name)
        vram = int(tier.group(1)) * GiB if tier else None
        variant = get_family_class(config.model.family).tiny_model_options(preset.name).get("variant")
        start = time.perf_counter()
        plan = plan_run(config, vram, 64 * GiB, args.gpu, variant=variant).as_dict()
        took = time.perf_counter() - start
        verdict = {True: "fits", False: "does not fit", None: "-"}[plan["fits"]]
        host = max(plan["host"]["load_peak"], plan["host"]["train_peak"])
        print(f"{preset.name:34} {plan['family']:10} {plan['device']['peak'] / GiB:9.2f} "
              f"{(f'{vram // GiB}' if vram else '-'):>7} {host / GiB:9.2f} {plan['transfer']['seconds_per_step']:7.2f} "
              f"{verdict:>12} {took:7.1f}", flush=True)
        for fix in plan["fixes"]:
            print(f"{'':34} fix: {fix}")


if __name__ == "__main__":
    main()
