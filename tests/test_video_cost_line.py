"""README's video cost line is tools/video_cost.py's output: its cache half is recomputed here
from the cache layout and the Wan VAE config (the plan half takes ~20 s of CPU to plan the real
width: `python -m tools.video_cost --write` regenerates both)."""

from __future__ import annotations


def test_the_readme_line_holds_the_cache_size_of_the_current_layout():
    from tools.video_cost import BEGIN, END, README, cache_phrase

    text = README.read_text(encoding="utf-8")
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    before, after = cache_phrase().split("[step]")
    assert block.startswith("Wan 2.1 1.3B LoRA (") and before in block and after in block, (block, before, after)
    assert block.endswith("Planned (`python -m tools.video_cost`), not measured on a GPU.")
