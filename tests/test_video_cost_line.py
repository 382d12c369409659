"""README's video cost lines are tools/video_cost.py's output: their cache halves are recomputed here
from the cache layout and each Wan VAE config (the plan halves take 20-60 s of CPU each to plan the
real width: `python -m tools.video_cost --write` regenerates them)."""

from __future__ import annotations


def test_the_readme_lines_hold_the_cache_size_of_the_current_layout():
    from tools.video_cost import BEGIN, END, README, RUNS, cache_phrase

    text = README.read_text(encoding="utf-8")
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    lines = [line for line in block.splitlines() if line.startswith("- ")]
    assert len(lines) == len(RUNS)
    for line, run in zip(lines, RUNS):
        before, after = cache_phrase(run).split("[step]")
        assert line.startswith(f"- {run.label} (") and before in line and after in line, (line, before, after)
    assert block.endswith("Planned (`python -m tools.video_cost`), not measured on a GPU.")
