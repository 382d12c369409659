"""The smallest change that makes a plan fit, as `--set` lines, each verified by re-planning."""

from __future__ import annotations


def find_fixes(planner, config, vram, ram, gpu_class_name) -> list[str]:
    return []
