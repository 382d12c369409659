"""Run one part of the GPU check in this process and write its result as JSON.

    python -m tools.gpu_check.part NAME --size dry|full --work DIR --result FILE

A part is tools/gpu_check/parts/NAME.py with `run(context) -> dict`: {"status": passed, failed or
skipped, "reason": ..., "figures": {...}, "cases": [{"name", "status", "reason", "figures"}]}.
A part whose run raises is failed, with the traceback's end as its error; a part of several cases
runs each through `record_case`, so one case's failure or the part's budget ends only that case.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent.parent
NO_TIME = "no time left in the part's budget"
REASON_CHARS = 400  # of an exception's message in a failed case's reason


@dataclass
class Context:
    size: str  # "dry": the smallest sizes, on the CPU; "full": the GPU sizes
    work: Path  # scratch space of this part
    budget_s: float  # the part's time; a part with several cases stops starting new ones near its end
    result_file: Path | None = None  # where the result goes; partial results too, so a timeout keeps them

    @property
    def dry(self) -> bool:
        return self.size == "dry"

    @property
    def device(self):
        import torch

        return torch.device("cpu" if self.dry or not torch.cuda.is_available() else "cuda")

    def save_partial(self, cases: list[dict]) -> None:
        """The cases finished so far, for the runner to report if the part is stopped at its budget."""
        if self.result_file is not None:
            self.result_file.with_suffix(".partial.json").write_text(json.dumps({"cases": cases}, default=str))

    def time_left(self, started: float) -> float:
        return self.budget_s - (time.monotonic() - started)


def failed_case(error: BaseException) -> dict:
    """A failed case's status and reason: what it raised."""
    return {"status": "failed", "reason": f"{type(error).__name__}: {str(error)[:REASON_CHARS]}"}


def record_case(context: Context, cases: list[dict], name: str, attempt: Callable[[], dict],
                started: float | None = None, seconds_needed: float = 0.0) -> dict:
    """Case `name` appended to `cases`: skipped where less than `seconds_needed` of the part's budget
    (counted from `started`) is left, else `attempt()`'s result ({"status", "reason", "figures"}), or
    failed with what it raised; then the cases so far are saved (Context.save_partial), so a part
    stopped at its budget still reports them. Returns the case."""
    if started is not None and context.time_left(started) < seconds_needed:
        case = {"status": "skipped", "reason": NO_TIME}
    else:
        try:
            case = attempt()
        except Exception as error:  # noqa: BLE001  (one case's failure is its result)
            case = failed_case(error)
    cases.append({"name": name, **case})
    context.save_partial(cases)
    return cases[-1]


def summary(cases: list[dict]) -> dict:
    """A part's status and reason from its cases': failed if one failed, passed if one passed."""
    failed = [case["name"] for case in cases if case["status"] == "failed"]
    if failed:
        return {"status": "failed", "reason": f"{len(failed)} of {len(cases)} failed: {', '.join(failed)}"}
    skipped = [case for case in cases if case["status"] == "skipped"]
    reason = f"{len(skipped)} of {len(cases)} skipped" if skipped else ""
    return {"status": "passed" if len(skipped) < len(cases) else "skipped", "reason": reason}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("--size", choices=["dry", "full"], default="full")
    parser.add_argument("--work", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--budget", type=float, default=60)
    args = parser.parse_args()
    result = run_named(args.name, args.size, Path(args.work), args.budget, Path(args.result))
    Path(args.result).write_text(json.dumps(result, default=str))
    return 0


def run_named(name: str, size: str, work: Path, budget: float, result_file: Path | None = None) -> dict:
    """Run part `name` in this process; its result, or failed with the traceback of what it raised."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    os.chdir(REPO)
    import launch  # noqa: F401  (its environment: offline hubs, the CUDA allocator, quiet library logs)

    context = Context(size, work, budget, result_file)
    context.work.mkdir(parents=True, exist_ok=True)
    try:
        return importlib.import_module(f"tools.gpu_check.parts.{name}").run(context)
    except Exception as error:  # noqa: BLE001  (a part's failure is its result)
        return {"status": "failed", "reason": f"{type(error).__name__}: {str(error)[:500]}",
                "error": traceback.format_exc()}


if __name__ == "__main__":
    sys.exit(main())
