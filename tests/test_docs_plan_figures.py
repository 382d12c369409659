"""The project's rule: memory claims come from its own plan or measurement, never by hand. A preset's
planned peak belongs in README's generated preset table (tools/preset_plans.py, from
resources/preset_plans.json); a doc that writes "planned 7.9 GiB of 8" goes stale with the next
re-plan (docs/families.md said so of FIBO Edit long after the plan said 6.9). Measured benchmark
figures, with their command and date, live in benchmarks/README.md, which this does not read."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# "planned 5.8 GiB", "plans 21.4 GiB", "7.9 GiB of 8": a plan's figure against a tier
PLAN_FIGURE = re.compile(r"\b(?:plans?|planned) ~?\d+(?:\.\d+)? ?GiB|\d+(?:\.\d+)? GiB of (?:6|8|12|16|24|48)\b")
# "2.54 GB", "10.1 GiB": a real model's size or memory, in the docs that are about memory
MODEL_SIZE = re.compile(r"\b\d+\.\d+ ?Gi?B\b")
MEMORY_DOCS = ("memory-and-offload.md",)
GENERATED = re.compile(r"<!-- BEGIN (?P<name>[\w-]+).*?<!-- END (?P=name) -->", re.S)


def hand_written(path: Path, pattern: re.Pattern = PLAN_FIGURE) -> list[str]:
    # (a generated section blanked to its newlines: the line numbers stay the file's)
    text = GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(REPO)}:{n}: {m.group(0)}" for n, line in enumerate(text.splitlines(), 1)
            for m in pattern.finditer(line)]


def test_docs_point_to_the_generated_table_instead_of_writing_plan_figures():
    found = [hit for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))] for hit in hand_written(path)]
    assert not found, "planned figures written by hand (point to README's preset table instead):\n" + "\n".join(found)


def test_the_memory_docs_point_to_the_plan_or_the_benchmarks_instead_of_writing_model_sizes():
    """Sizes of real models' parts (parked bytes, activations) are the plan's (`launch.py plan`) or a
    benchmark's (benchmarks/README.md, with its command); copied into a doc they go stale."""
    found = [hit for name in MEMORY_DOCS for hit in hand_written(REPO / "docs" / name, MODEL_SIZE)]
    assert not found, "model sizes written by hand (point to the plan or benchmarks/README.md):\n" + "\n".join(found)
