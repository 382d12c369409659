"""The GPU check kit (tools/gpu_check/) keeps working without a GPU: its CPU dry run runs every
part at the smallest size and reports each as passed or skipped with a reason; its torch API scan
finds an API the running torch lacks; its wheel re-packing drops the libraries a box does not load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tools.gpu_check.runner import PARTS

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out)}
    command = [str(ROOT / "tools" / "gpu_check" / "run.sh"), "--cpu-dry-run", "--work", str(out / "work")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=850,
                          stdin=subprocess.DEVNULL)  # (the train CLI reads commands from stdin)
    return json.loads((out / "report.json").read_text()), out, done


def test_the_cpu_dry_run_runs_every_part_and_each_passes_or_skips_with_a_reason(dry_run):
    report, out, done = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["mode"] == "cpu-dry-run" and report["finished"]
    parts = {part["name"]: part for part in report["parts"]}
    assert list(parts) == [name for name, _ in PARTS]
    for name, part in parts.items():
        assert part["status"] in ("passed", "skipped"), (name, part.get("reason"), part.get("error", "")[-2000:])
        if part["status"] == "skipped":
            assert part["reason"], name
    assert parts["cuda_tests"]["figures"]["skipped"] > 0  # the suite's CUDA tests were found and ran (skipping)
    assert parts["torch_compat"]["figures"]["modules_imported"] > 100
    assert parts["families"]["cases"][0]["status"] == "passed"  # train, sample, backup, save, resume
    width = {case["name"]: case for case in parts["real_width"]["cases"]}
    assert set(width) == {"sdxl_unet", "flux1_slice", "sdxl_unet_nf4"}
    assert width["sdxl_unet"]["status"] == width["flux1_slice"]["status"] == "passed"
    assert all(case["figures"]["offload_0.5"]["blocks_parked"] > 0 for case in width.values() if "figures" in case)
    compared = parts["plan_vs_measured"]["cases"]  # the plan against the trainer's memory event, per offload
    assert [case["name"] for case in compared] == ["sdxl offload 0.0", "sdxl offload 0.5"]
    # the dry run's measure is the CPU's RSS over the load's start, in a process whose earlier parts
    # already peaked: it may even be negative (CI once measured -0.0002 GiB). The plumbing is checked
    # (the event read, the plan made, a ratio computed), not the figure
    assert all(case["status"] == "passed" and isinstance(case["figures"]["ratio"], float) for case in compared), \
        compared
    assert compared[1]["figures"]["parked_blocks"] != compared[0]["figures"]["parked_blocks"]
    assert parts["background_plan"]["figures"]["unplanned"] is None  # the child's plan came
    markdown = (out / "report.md").read_text()
    assert all(f"## {name}: " in markdown for name in parts)


def test_a_planned_peak_is_measured_as_the_device_allocates_and_held_to_ten_percent():
    from tools.gpu_check.parts.plan_vs_measured import measured_peak, verdict

    assert measured_peak({"device_peak_allocated": 5, "host_peak_rss": 90, "host_rss_before_load": 10}) == (
        5, "device peak allocated")
    assert measured_peak({"device_peak_allocated": None, "host_peak_rss": 90, "host_rss_before_load": 10})[0] == 80
    assert verdict(100, 109, dry=False) == verdict(100, 91, dry=False) == {"status": "passed"}
    over, under = verdict(100, 111, dry=False), verdict(100, 89, dry=False)
    assert over["status"] == under["status"] == "failed" and "1.11x the planned" in over["reason"]
    assert verdict(100, 300, dry=True) == {"status": "passed"}  # the CPU's measure: the plumbing, not the 10%


def test_the_torch_api_scan_finds_an_unguarded_api_this_torch_lacks(tmp_path):
    from tools.gpu_check.torch_api_scan import scan

    planted = tmp_path / "planted.py"
    planted.write_text(
        "import torch\nfrom torch import nn\nimport torch.nn.functional as F\n"
        "x = torch.no_such_api_before_3(1)\n"  # missing, unguarded: a finding
        "y = nn.Linear(2, 2)\nz = F.silu\n"  # present
        "if hasattr(torch, 'no_such_api_guarded'):\n    torch.no_such_api_guarded()\n"  # missing, guarded
        "try:\n    from torch.no_such_module import thing\nexcept ImportError:\n    thing = None\n")
    result = scan([planted], tmp_path)
    assert result.missing == ["planted.py:4: torch.no_such_api_before_3"]
    assert sorted(result.guarded_missing) == ["planted.py:10: torch.no_such_module.thing",
                                              "planted.py:8: torch.no_such_api_guarded"]
    assert result.uses == 7  # three imports from torch, four attribute chains


def test_repacking_a_wheel_keeps_only_the_named_libraries(tmp_path):
    from tools.gpu_check.repack_wheel import repack

    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    names = ["pkg/__init__.py", "pkg/libpkg_cpu.so", "pkg/libpkg_cuda126.so", "pkg/libpkg_cuda130.so"]
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in names:
            archive.writestr(name, b"x" * 1000)
        archive.writestr("pkg-1.0.dist-info/RECORD", "".join(f"{name},sha256=0,1000\n" for name in names))
    repack(str(wheel), ["libpkg_cuda130", "libpkg_cpu"])
    with zipfile.ZipFile(wheel) as archive:
        assert sorted(archive.namelist()) == ["pkg-1.0.dist-info/RECORD", "pkg/__init__.py", "pkg/libpkg_cpu.so",
                                              "pkg/libpkg_cuda130.so"]
        assert "cuda126" not in archive.read("pkg-1.0.dist-info/RECORD").decode()
    with pytest.raises(SystemExit, match="no library matches"):
        repack(str(wheel), ["libpkg_cuda999"])


def test_names_are_looked_up_in_another_torchs_wheel(tmp_path):
    from tools.gpu_check.torch_names_in_wheel import absent, wheel_identifiers

    wheel = tmp_path / "torch-2.11.0-cp312-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("torch/__init__.py", "from torch import nn\ndef compile(model): ...\n")
        archive.writestr("torch/nn/__init__.py", "class Linear: ...\n")
        archive.writestr("torch/lib/libtorch.dylib", "new_api")  # not a source file
    known = wheel_identifiers(str(wheel))
    used = {"torch.nn.Linear", "torch.compile", "torch.new_api", "torch.nn.NewLayer"}
    assert absent(used, known) == ["torch.new_api", "torch.nn.NewLayer"]


def test_a_part_stopped_at_its_budget_keeps_the_cases_it_finished(tmp_path, monkeypatch):
    from tools.gpu_check import runner

    def stopped(command, **kwargs):  # the part wrote one case, then ran past its budget
        result = Path(command[command.index("--result") + 1])
        result.with_suffix(".partial.json").write_text(json.dumps({"cases": [{"name": "sd15", "status": "passed"}]}))
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(runner.subprocess, "run", stopped)
    result = runner.run_part("families", 7, tmp_path)
    assert result["status"] == "timeout" and "budget of 7 s" in result["reason"]
    assert result["cases"] == [{"name": "sd15", "status": "passed"}]


def test_a_part_gets_its_budget_and_what_the_parts_before_it_left_unused(tmp_path, monkeypatch):
    from tools.gpu_check import runner

    budgets = {}

    def quick(name, budget, work):  # every part done at once: its whole budget left over
        budgets[name] = budget
        return {"name": name, "status": "passed", "seconds": 0.0}

    monkeypatch.setattr(runner, "run_part", quick)
    runner.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    planned = 0
    for name, seconds in runner.PARTS:
        planned += seconds
        expected = min(planned, runner.GPU_TOTAL_S - runner.RESERVE_S)  # never past the check's total
        assert expected - 2 < budgets[name] <= expected, name  # (2 s for this box's own slowness)


def test_a_parts_case_is_tried_failed_on_what_it_raises_skipped_past_the_budget_and_saved(tmp_path):
    """tools/gpu_check/part.record_case, the loop of every part of several cases: one case raising
    fails that case alone, one the budget has no room for is skipped, and each is saved at once."""
    import time

    from tools.gpu_check.part import Context, record_case

    context = Context("dry", tmp_path, budget_s=60, result_file=tmp_path / "result.json")
    started, cases = time.monotonic(), []

    def raises() -> dict:
        raise RuntimeError("out of memory")

    record_case(context, cases, "ok", lambda: {"status": "passed", "figures": {"x": 1}}, started, 10)
    record_case(context, cases, "raises", raises, started, 10)
    record_case(context, cases, "late", lambda: pytest.fail("started with no time left"), started, 120)
    assert cases == [{"name": "ok", "status": "passed", "figures": {"x": 1}},
                     {"name": "raises", "status": "failed", "reason": "RuntimeError: out of memory"},
                     {"name": "late", "status": "skipped", "reason": "no time left in the part's budget"}]
    assert json.loads((tmp_path / "result.partial.json").read_text()) == {"cases": cases}
