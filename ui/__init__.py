"""The desktop GUI (customtkinter). `python launch.py` with no arguments starts it (ui/app.py)."""

from __future__ import annotations

import os
import sys


def display_available() -> bool:
    """Whether a window can open here (checked before tkinter is imported)."""
    if sys.platform in ("win32", "darwin"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
