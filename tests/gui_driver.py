"""Driving the real window in GUI tests: pump the Tk loop, set fields, type, screenshot, wait for runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

TABS = ["General", "Model", "Concepts", "Training", "Adapter", "Embeddings", "Offload", "Sampling", "Backup", "Run"]


def pump(app, until=None, timeout: float = 5.0, what: str = "the condition"):
    """Run the Tk event loop until `until()` is true (or for `timeout` seconds when it is None)."""
    import tkinter

    deadline = time.monotonic() + timeout
    while True:
        try:
            app.update()
        except tkinter.TclError:  # the window was closed
            pass
        if until is not None and until():
            return
        if time.monotonic() > deadline:
            if until is None:
                return
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def fresh(app):
    """Defaults again, no dialogs, the General tab."""
    from ui.state import default_data

    for dialog in app.dialogs:
        if dialog.winfo_exists():
            dialog.destroy()
    app.dialogs.clear()
    app.cfg.load(default_data())
    app.tabview.set("General")
    pump(app, timeout=0.1)


def field(app, tab: str, path: str):
    return app.tabs[tab].fields[path]


def edit(app, tab: str, path: str, value) -> None:
    """What choosing a value in the widget does: its Tk variable changes."""
    widget = field(app, tab, path)
    widget.var.set(value)
    pump(app, timeout=0.05)


def type_text(app, widget, text: str) -> None:
    """Real key presses (xdotool) into the entry of a Field, replacing its content."""
    if shutil.which("xdotool") is None:
        pytest.skip("typing into the window needs xdotool (apt-get install xdotool)")
    entry = widget.input._entry
    app.tabview.set(next(name for name, tab in app.tabs.items() if widget.path in getattr(tab, "fields", {})))
    pump(app, timeout=0.2)
    entry.focus_force()
    entry.delete(0, "end")
    pump(app, lambda: app.focus_get() is entry, timeout=5, what="focus on the entry")
    subprocess.run(["xdotool", "type", "--delay", "20", text], check=True, timeout=30)
    pump(app, lambda: widget.var.get() == text, timeout=10, what=f"typed text {text!r}")


def screenshot(app, path: Path) -> Path:
    from PIL import ImageGrab

    x, y = app.winfo_rootx(), app.winfo_rooty()
    image = ImageGrab.grab(bbox=(x, y, x + app.winfo_width(), y + app.winfo_height()), xdisplay=os.environ["DISPLAY"])
    image.save(path)
    return path


def configure_tiny_run(app, tiny_model: Path, images: Path, folder: Path, epochs: int = 2) -> None:
    """Set up a short run on the tiny model through the tabs, as a user would."""
    edit(app, "Model", "model.base", str(tiny_model))
    app.tabs["Concepts"].add()  # the "Add concept" button
    pump(app, timeout=0.05)
    edit(app, "Concepts", "concepts[0].path", str(images))
    app.tabs["Sampling"].add()  # the "Add prompt" button
    pump(app, timeout=0.05)
    for path, value in {"sampling.prompts[0].prompt": "a red circle", "sampling.prompts[0].steps": "2",
                        "sampling.prompts[0].width": "64", "sampling.prompts[0].height": "64",
                        "schedule.sample_every.value": "2"}.items():
        edit(app, "Sampling", path, value)
    for path, value in {"schedule.epochs": str(epochs), "schedule.batch_size": "2", "data.resolution": "64",
                        "optimizer.lr": "0.005"}.items():
        edit(app, "Training", path, value)
    for path, value in {"adapter.rank": "4", "adapter.alpha": "2", "adapter.layer_preset": "attn"}.items():
        edit(app, "Adapter", path, value)
    edit(app, "Model", "output.path", str(folder / "out" / "lora.safetensors"))
    edit(app, "Model", "output.dtype", "float32")
    edit(app, "General", "workspace_dir", str(folder / "ws"))
    edit(app, "General", "train_device", "cpu")
    edit(app, "General", "tensorboard", False)
    assert app.cfg.problems == [], app.cfg.problems


def wait_for_event(app, name: str, timeout: float = 120) -> None:
    try:
        pump(app, lambda: any(e["event"] == name for e in app.run_events), timeout=timeout, what=f"a {name} event")
    except AssertionError as error:
        raise AssertionError(f"{error}; events: {[e['event'] for e in app.run_events]}; "
                             f"log: {app.tabs['Run'].log_text()[-2000:]}") from None


def run_to_end(app, timeout: float = 90) -> int:
    pump(app, lambda: app.client is not None and not app.client.running and not app.running
         and app.start_button.cget("text") == "Start training", timeout=timeout, what="the run to end")
    return app.client.returncode


FAKE_RUN = """
import json, os, sys, time
def emit(**event):
    print(json.dumps(event), flush=True)
emit(event="started", total_steps=2)
if sys.argv[1] == "fail":
    print("Traceback-free log line on stderr", file=sys.stderr, flush=True)
    emit(event="error", message="model.base: /nowhere is not a model folder")
    sys.exit(1)
# argv[2]: seconds to run, or a file to wait for (up to 60 s), so that a test, not the machine's
# load, decides when the run ends
try:
    time.sleep(float(sys.argv[2]))
except ValueError:
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.05)
emit(event="progress", step=1, total_steps=2, epoch=0, epochs=1, loss=0.5, lr=1e-4, it_per_s=1.0, eta_s=1.0)
open(sys.argv[3], "w").write("done")
emit(event="finished")
"""


def fake_run_argv(*args: str) -> list[str]:
    """A child that speaks the run protocol without training (for what the window does with it)."""
    return [sys.executable, "-c", FAKE_RUN, *args]
