"""A process that only plans imports diffusers and transformers without bitsandbytes, torchao and
peft (modules/util/planning_imports.py), still imports them itself where a weight mode needs them,
and every other process sees them as installed, as before."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HIDDEN = ("bitsandbytes", "torchao", "peft")


def _run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def test_launch_plan_leaves_the_kernel_libraries_out():
    seen = _run(
        "import contextlib, io, json, sys, launch\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    code = launch.main(['plan', '--preset', 'SD1.5 LoRA', '--vram', '8GiB', '--ram', '64GiB', '--json'])\n"
        "import diffusers.utils as du\n"
        f"print(json.dumps({{'code': code, 'imported': [n for n in {HIDDEN!r} if n in sys.modules],"
        " 'peft_backend': du.USE_PEFT_BACKEND}))\n")
    assert seen["code"] == 0
    assert seen["imported"] == []  # none of them: the plan of a bfloat16 LoRA needs none
    assert seen["peft_backend"] is False


def test_a_planning_process_still_imports_them_itself():
    """The hiding ends once diffusers and transformers are in: nf4 and int8 layers import their
    library when a plan runs them."""
    present = [name for name in HIDDEN if _installed(name)]
    if not present:
        pytest.skip("none of bitsandbytes, torchao, peft installed")
    seen = _run(
        "import importlib, json, sys\n"
        "from modules.util.planning_imports import import_model_libraries_for_planning\n"
        "import_model_libraries_for_planning()\n"
        "assert 'diffusers' in sys.modules and 'transformers' in sys.modules\n"
        f"print(json.dumps([importlib.import_module(n).__name__ for n in {present!r}]))\n")
    assert seen == present


def test_a_training_process_sees_them_installed():
    """Training (and everything else but planning) imports the libraries as they are: diffusers'
    quantizers and LoRA backend stay on."""
    seen = _run(
        "import json, launch\n"
        "from modules.cli.train_command import run_training  # noqa: F401\n"
        "import diffusers.utils as du\n"
        "from diffusers.utils import import_utils as iu\n"
        "print(json.dumps({'bitsandbytes': iu.is_bitsandbytes_available(), 'torchao': iu.is_torchao_available(),"
        " 'peft': iu.is_peft_available(), 'peft_backend': du.USE_PEFT_BACKEND}))\n")
    for name in HIDDEN:
        assert seen[name] is _installed(name)
    if _installed("peft"):
        assert seen["peft_backend"] is True
