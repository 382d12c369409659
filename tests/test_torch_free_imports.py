"""The config and the GUI load without torch (issue 31 item 5, issue 30 defect 11): importing torch
takes seconds, so a window or a config check that needs it starts that much later. Each check runs
in a fresh interpreter, since the test process has long imported torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "diffusers", "transformers")


def heavy_modules_after(code: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", f"import sys\n{code}\nprint(sorted(m for m in {HEAVY!r} "
                                                   "if m in sys.modules))"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return eval(result.stdout.strip().splitlines()[-1])  # noqa: S307  (a list of names printed above)


def test_the_config_builds_without_torch():
    assert heavy_modules_after("from modules.config.train_config import TrainConfig\nTrainConfig()") == []


def test_the_gui_imports_without_torch():
    assert heavy_modules_after("import ui.app") == []
