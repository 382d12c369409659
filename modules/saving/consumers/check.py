"""Which modules of a saved adapter file each consumer applies, by its key map: the proof a save
logs ("ComfyUI: 42/42 modules applied") and carries in its `saved` event."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from modules.saving.consumers import comfyui, forge

CONSUMERS = (comfyui, forge)
# a module's tensors: the file's keys are `<stem>.<one of these>`
TENSORS = re.compile(r"\.(lora_down\.weight|lora_up\.weight|lora_A\.weight|lora_B\.weight|lora_magnitude_vector|alpha"
                     r"|hada_\w+|lokr_\w+|oft_blocks|dora_scale)$")
# the tool each format is written for (docs/formats.md): a save it drops keys of is warned
TARGETS = {"comfy": ("ComfyUI",), "kohya": ("ComfyUI", "Forge")}
SHOWN = 5  # dropped stems named in a log line; the rest counted


def module_stems(keys: Iterable[str]) -> set[str]:
    """The adapted modules of a file: its keys less their tensor suffixes."""
    return {TENSORS.sub("", k) for k in keys}


def check(keys: Iterable[str], family) -> dict[str, dict]:
    """Per consumer whose map is kept for this family: {"applied": n, "total": m, "dropped": [stems]}."""
    modules = module_stems(keys)
    report = {}
    for consumer in CONSUMERS:
        known = consumer.stems(family)
        if known is None:
            continue
        dropped = sorted(modules - known)
        report[consumer.NAME] = {"applied": len(modules) - len(dropped), "total": len(modules), "dropped": dropped}
    return report


def check_file(path: str | Path, family) -> dict[str, dict]:
    """check() over a saved .safetensors file's keys (read from its header only)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        return check(file.keys(), family)


def summary(name: str, result: dict) -> str:
    """"ComfyUI: 42/42 modules applied" or the dropped stems (the first few and how many)."""
    line = f"{name}: {result['applied']}/{result['total']} modules applied"
    dropped = result["dropped"]
    if dropped:
        more = f" and {len(dropped) - SHOWN} more" if len(dropped) > SHOWN else ""
        line += f"; drops {len(dropped)}: {', '.join(dropped[:SHOWN])}{more}"
    return line


def target_drops(fmt: str, report: dict[str, dict]) -> list[str]:
    """summary() lines of the format's own target tools that drop modules."""
    return [summary(name, report[name]) for name in TARGETS.get(fmt, ()) if name in report and report[name]["dropped"]]


def is_report(value) -> bool:
    """Whether `value` (an event's `consumers`, from another process) has check()'s shape."""
    return isinstance(value, dict) and all(
        isinstance(name, str) and isinstance(result, dict) and isinstance(result.get("applied"), int)
        and isinstance(result.get("total"), int) and isinstance(result.get("dropped"), list)
        for name, result in value.items())
