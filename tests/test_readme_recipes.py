"""README's recipes run as written, so they cannot rot.

Every ```bash block of README.md either runs here, literally, in a fresh folder holding this
checkout's launch.py, modules/ and resources/ (one shell, in README's order, so the demo's tiny
model serves the recipes after it), or is marked just before it with
`<!-- recipe: needs ... -->` saying what it needs that a test has not (network, real weights, a
GPU, a display). A ```json block marked `<!-- recipe: file NAME -->` is written to NAME first.
The blocks that run are the demo (50 steps at 64 px) and the tiny versions of the LoRA and
resume recipes (4 steps each): about 40 s on an idle 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = re.compile(r"^<!-- recipe: (.+?) -->$")
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
REASONS = ("needs network", "needs real weights", "needs a GPU", "needs a display", "needs an ssh host")


@dataclass
class Block:
    lang: str
    code: str
    marker: str | None  # the recipe comment just before the block, if any
    line: int


def readme_blocks(text: str) -> list[Block]:
    blocks = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        marker = MARKER.match(before)
        blocks.append(Block(match.group(1), match.group(2), marker.group(1) if marker else None,
                            text.count("\n", 0, match.start()) + 1))
    return blocks


def plan(blocks: list[Block]) -> tuple[list[Block], list[Block], list[Block]]:
    """(files to write, shell blocks to run, shell blocks skipped with their reason)."""
    files, run, skipped = [], [], []
    for block in blocks:
        marker = block.marker or ""
        if block.lang == "bash":
            if marker.startswith("needs"):
                assert marker.startswith(REASONS), (
                    f"README.md line {block.line}: '{marker}' is no known reason to skip a recipe {REASONS}")
                skipped.append(block)
            else:
                assert not marker, f"README.md line {block.line}: unknown recipe marker '{marker}'"
                run.append(block)
        elif marker.startswith("file "):
            files.append(block)
    return files, run, skipped


def test_every_shell_block_runs_or_says_what_it_needs():
    blocks = readme_blocks(README.read_text(encoding="utf-8"))
    files, run, skipped = plan(blocks)
    assert len(run) + len(skipped) == sum(b.lang == "bash" for b in blocks)
    assert any("launch.py demo" in b.code for b in run), "the demo must be one of the recipes run"
    for block in blocks:
        if block.lang == "json":  # every config shown is valid JSON
            json.loads(block.code)


def test_readme_test_command_is_the_one_ci_runs():
    blocks = readme_blocks(README.read_text(encoding="utf-8"))
    command = next(b for b in blocks if "pytest" in b.code).code.strip().splitlines()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert command == ["pip install -r requirements-test.txt", "python -m pytest -q -n auto --dist loadfile"]
    for line in command:
        assert line in ci, f".ci/run no longer runs README's '{line}'"


def test_readme_recipes_run(tmp_path):
    files, run, _ = plan(readme_blocks(README.read_text(encoding="utf-8")))
    for name in ("launch.py", "modules", "resources"):
        (tmp_path / name).symlink_to(ROOT / name)
    for block in files:
        (tmp_path / block.marker.removeprefix("file ").strip()).write_text(block.code, encoding="utf-8")
    script = "set -euo pipefail\n" + "\n".join(block.code for block in run)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "DIFFTRAINER_HOME": str(tmp_path / "home")}
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"README recipe failed:\n{script}\n--- stderr ---\n{result.stderr[-4000:]}"
    # what the recipes promise they write
    assert (tmp_path / "workspace/demo/output/demo-lora.safetensors").is_file()
    assert (tmp_path / "workspace/try/my-lora.safetensors").is_file()
    resumed = sorted((tmp_path / "workspace/try/backup").glob("*-step*"))
    assert resumed and resumed[-1].name.endswith("step0000008"), "the resume recipe trains one epoch more"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
