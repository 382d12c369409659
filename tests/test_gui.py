"""The desktop GUI in a real window (Xvfb when no DISPLAY is set): tabs, binding and validation,
runs started from the window as child processes, presets through the preset bar, and the GUI and
`launch.py train` training the same adapter from the same preset.

One App serves the whole module (tests run in file order); the last test closes it during a run
and opens a new one to check that the last config comes back.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TABS = ["General", "Model", "Concepts", "Training", "Adapter", "Embeddings", "Offload", "Sampling", "Backup", "Run"]


# --- the display and the app -----------------------------------------------------------------------

def _die_with_parent() -> None:
    """In the Xvfb child: get SIGTERM when the test process dies, however it dies (Linux)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@pytest.fixture(scope="session")
def display():
    """The X display the windows open on: $DISPLAY, or an Xvfb started here for the whole session
    (Tk keeps its connection to the display for the life of the process, so the server must
    outlive every test that opened a window)."""
    if os.environ.get("DISPLAY"):
        yield os.environ["DISPLAY"]
        return
    if shutil.which("Xvfb") is None:
        pytest.skip("GUI tests need a display: DISPLAY is unset and Xvfb is not installed (apt-get install xvfb)")
    # -displayfd: Xvfb picks a free display and writes its number when it is ready, so test
    # processes started side by side (pytest -n) never race for the same number.
    read_end, write_end = os.pipe()
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write_end), "-screen", "0", "1280x900x24", "-nolisten", "tcp"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(write_end,),
                              preexec_fn=_die_with_parent)
    os.close(write_end)
    with os.fdopen(read_end) as ready:
        ready_fds = select.select([ready], [], [], 20)[0]
        number = ready.readline().strip() if ready_fds else ""
    if not number.isdigit():
        server.kill()
        pytest.fail("Xvfb did not start (no display number within 20 s)")
    os.environ["DISPLAY"] = f":{number}"
    try:
        yield os.environ["DISPLAY"]
    finally:
        del os.environ["DISPLAY"]
        server.terminate()
        server.wait(10)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """DIFFTRAINER_HOME for the app and the runs it starts (user presets, last config, run folders)."""
    folder = tmp_path_factory.mktemp("difftrainer-home")
    old = os.environ.get("DIFFTRAINER_HOME")
    os.environ["DIFFTRAINER_HOME"] = str(folder)
    yield folder
    if old is None:
        del os.environ["DIFFTRAINER_HOME"]
    else:
        os.environ["DIFFTRAINER_HOME"] = old


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


@pytest.fixture(scope="module")
def app(display, home):
    from ui.app import App

    window = App(restore=False)  # machine info comes from a real `launch.py info --json` child
    pump(window, lambda: window.cfg.machine_info is not None, timeout=90, what="launch.py info")
    yield window
    try:
        if window.client is not None:
            window.client.kill()
        window.destroy()
    except Exception:  # already closed by the last test
        pass


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


# --- tests ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where screenshots go: $GUI_SCREENSHOTS, or a temp folder (printed with -s)."""
    folder = Path(os.environ.get("GUI_SCREENSHOTS") or tmp_path_factory.mktemp("gui-screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\nGUI screenshots: {folder}")
    return folder


def test_tabs_render_with_screenshots(app, shots):
    fresh(app)
    folder = shots
    from PIL import Image

    for name in TABS:
        app.tabview.set(name)
        pump(app, timeout=0.3)
        body = app.tabs[name]
        assert body.winfo_ismapped(), f"tab {name} is not shown"
        shot = screenshot(app, folder / f"{name.lower()}.png")
        colors = Image.open(shot).convert("L").getextrema()
        assert colors[1] - colors[0] > 50, f"the {name} screenshot is blank"
    assert app.callback_errors == []


def test_model_tab_offers_only_working_weight_dtypes(app):
    fresh(app)
    working = app.cfg.machine_info["families"]["sd15"]["weight_dtypes"]
    menu = field(app, "Model", "model.parts.unet.weight_dtype").input
    assert set(menu.cget("values")) == set(working) | {"auto"}


def test_editing_a_field_changes_the_config(app):
    fresh(app)
    type_text(app, field(app, "Adapter", "adapter.rank"), "8")
    assert app.cfg.data["adapter"]["rank"] == 8
    assert app.cfg.config.adapter.rank == 8
    edit(app, "Offload", "model.parts.unet.gradient_checkpointing", True)
    assert app.cfg.config.model.parts["unet"].gradient_checkpointing is True
    app.method_menu.set("DoRA")
    app._method_chosen("DoRA")  # what picking it in the menu calls
    assert (app.cfg.config.adapter.type, app.cfg.config.adapter.dora) == ("lora", True)
    assert field(app, "Adapter", "adapter.dora").var.get() is True
    assert app.callback_errors == []


def test_family_selector_rebuilds_the_part_sections(app):
    from modules.model.registry import family_names, get_family_class

    fresh(app)
    for name in [*family_names(), "sd15"]:
        family = get_family_class(name)
        app.family_menu.set(family.label)
        app._family_chosen(family.label)  # what picking it in the menu calls
        pump(app, timeout=0.05)
        parts = list(family.default_parts())
        assert app.cfg.data["model"]["family"] == name
        assert app.tabs["Model"].sections.names == parts
        assert f"model.parts.{parts[-1]}.offload_fraction" in app.tabs["Offload"].fields
    assert app.callback_errors == []


def test_invalid_value_is_marked_and_blocks_start(app, tiny_model, shape_images, tmp_path):
    fresh(app)
    configure_tiny_run(app, tiny_model, shape_images, tmp_path)
    # a rule across fields lands on the field it names
    edit(app, "Offload", "model.parts.unet.offload_fraction", "0.5")
    offload = field(app, "Offload", "model.parts.unet.offload_fraction")
    assert "needs gradient_checkpointing" in offload.error_text
    app.start_button.invoke()
    pump(app, timeout=0.2)
    assert app.client is None, "a run started with an invalid config"
    assert [p.split(":")[0] for p in app.refused] == ["model.parts.unet.offload_fraction"]
    edit(app, "Offload", "model.parts.unet.offload_fraction", "0.0")
    assert offload.error_text == ""
    # a value typed into a field
    rank = field(app, "Adapter", "adapter.rank")
    type_text(app, rank, "abc")
    assert rank.error_text == "must be a whole number (got 'abc')"
    assert rank.error.winfo_ismapped()
    app.start_button.invoke()
    pump(app, timeout=0.2)
    assert app.client is None, "a run started with an invalid config"
    assert app.refused == ["adapter.rank: must be a whole number (got 'abc')"]
    assert app.dialogs and "adapter.rank: must be a whole number" in app.dialogs[-1].message
    type_text(app, rank, "4")
    assert rank.error_text == "" and app.cfg.problems == []


def test_remote_host_runs_through_modules_remote(app, tmp_path):
    general = app.tabs["General"]
    general.remote_vars["host"].set("trainer@gpu-box")
    general.remote_vars["port"].set("2222")
    pump(app, timeout=0.05)
    argv = app.run_argv(tmp_path / "config.json")
    assert argv[1:4] == [str(ROOT / "launch.py"), "remote", "--protocol"]
    assert argv[argv.index("--host") + 1] == "trainer@gpu-box" and argv[argv.index("--port") + 1] == "2222"
    assert argv[argv.index("--config") + 1] == str(tmp_path / "config.json")
    general.remote_vars["port"].set("twenty")
    pump(app, timeout=0.05)
    assert general.remote_error.cget("text").startswith("remote: port")
    for var in general.remote_vars.values():
        var.set("") if var is general.remote_vars["host"] or var is general.remote_vars["port"] else None
    pump(app, timeout=0.05)
    assert app.remote_target() is None and general.remote_error.cget("text") == ""
    assert app.run_argv(tmp_path / "c.json")[2:4] == [str(ROOT / "launch.py"), "train"]


PRESET = "gui test preset"


def test_preset_bar_save_and_load(app, tiny_model, shape_images, tmp_path_factory, monkeypatch):
    import customtkinter as ctk

    from modules.config.presets import user_presets_dir

    fresh(app)
    configure_tiny_run(app, tiny_model, shape_images, tmp_path_factory.mktemp("gui-run"))

    class NameDialog:  # the "Save as…" dialog, answered
        def __init__(self, **_kwargs):
            pass

        def get_input(self):
            return PRESET

    monkeypatch.setattr(ctk, "CTkInputDialog", NameDialog)
    app.save_as_button.invoke()
    saved = user_presets_dir() / f"{PRESET}.json"
    assert saved.is_file()
    assert PRESET in app.preset_menu.cget("values")

    app.reset_button.invoke()
    pump(app, timeout=0.1)
    assert app.cfg.data["adapter"]["rank"] == 16 and app.cfg.data["concepts"] == []
    assert field(app, "Adapter", "adapter.rank").var.get() == "16"

    app.preset_var.set(PRESET)
    app.load_button.invoke()
    pump(app, timeout=0.1)
    assert app.cfg.data["adapter"]["rank"] == 4
    assert app.cfg.data["adapter"]["layer_preset"] == "attn"
    assert field(app, "Adapter", "adapter.rank").var.get() == "4"
    assert field(app, "Concepts", "concepts[0].path").var.get() == str(shape_images)
    assert app.cfg.problems == []

    # export and import a config file (the buttons open file dialogs for these paths)
    exported = tmp_path_factory.mktemp("export") / "exported.json"
    before = app.cfg.config
    app.export_config(str(exported))
    app.reset_button.invoke()
    assert app.cfg.data["adapter"]["rank"] == 16
    app.import_config(str(exported))
    pump(app, timeout=0.05)
    assert app.cfg.config == before
    assert field(app, "Adapter", "adapter.layer_preset").var.get() == "attn"


@pytest.fixture(scope="module")
def gui_run(app, shape_images):
    """The saved preset loaded through the preset bar and trained with the Start button."""
    app.preset_var.set(PRESET)
    app.load_button.invoke()
    pump(app, timeout=0.1)
    app.tabview.set("Concepts")
    # the preview is rebuilt from the event loop: wait for it to exist, then for its count
    pump(app, lambda: bool(app.tabs["Concepts"].previews)
         and "4 images" in app.tabs["Concepts"].previews[0]["count"].cget("text"), timeout=30,
         what="the concept preview")
    statuses = []
    app.start_button.invoke()
    assert app.client is not None, app.refused
    assert app.start_button.cget("text") == "Stop"

    def progressed():
        statuses.append(app.status_label.cget("text"))
        return not app.running

    pump(app, progressed, timeout=120, what="the GUI run to finish")
    run_to_end(app)
    pump(app, timeout=0.5)  # the last plot redraw
    return {"events": list(app.run_events), "returncode": app.client.returncode, "statuses": statuses,
            "output": Path(app.cfg.data["output"]["path"])}


def test_concept_preview_shows_count_and_thumbnails(app, gui_run, shots):
    app.tabview.set("Concepts")
    pump(app, timeout=0.3)
    screenshot(app, shots / "concepts-preview.png")
    concepts = app.tabs["Concepts"]
    preview = concepts.previews[0]
    assert preview["count"].cget("text").startswith("4 images")
    assert preview["buckets"].cget("text").startswith("Buckets: 64x64: 4")  # resolution 64, square images
    seen = set()
    for _ in range(4):  # the ▶ button: each image with the caption training uses
        assert len(preview["images"]) == 1
        text = preview["caption"].cget("text")
        assert "Trained caption: " in text and "(empty)" not in text
        seen.add(text.splitlines()[0])
        concepts.browse(0, 1)
    assert len(seen) == 4


def test_run_from_gui_completes_with_progress_loss_and_gallery(app, gui_run, shots):
    app.tabview.set("Run")
    pump(app, timeout=0.3)
    screenshot(app, shots / "run-finished.png")
    names = [e["event"] for e in gui_run["events"]]
    assert gui_run["returncode"] == 0, app.tabs["Run"].log_text()[-3000:]
    assert names[0] == "started" and names[-1] == "finished"
    progress = [e for e in gui_run["events"] if e["event"] == "progress"]
    assert [e["step"] for e in progress] == [1, 2, 3, 4]
    assert any(s.startswith("step ") and "loss " in s and "ETA " in s for s in gui_run["statuses"])
    assert any(s.startswith("step 4/4   epoch 2/2   loss ") for s in gui_run["statuses"])
    assert app.progress.get() == pytest.approx(1.0) and app.epoch_progress.get() == pytest.approx(1.0)
    assert app.status_label.cget("text") == "Finished."
    run_tab = app.tabs["Run"]
    assert run_tab.steps == [1, 2, 3, 4] and run_tab.redraws >= 1
    assert list(run_tab.line.get_xdata()) == [1, 2, 3, 4]
    samples = [e["path"] for e in gui_run["events"] if e["event"] == "sample"]
    assert len(samples) == 2 and run_tab.samples == samples and len(run_tab._images) == 2
    assert "saved: " in run_tab.log_text()  # the run's log
    assert gui_run["output"].is_file()
    assert app.dialogs == [] and app.callback_errors == []


def test_same_preset_from_gui_and_cli_gives_the_same_adapter(app, gui_run, tmp_path):
    from safetensors.torch import load_file

    cli_output = tmp_path / "cli.safetensors"
    env = dict(os.environ)  # as the GUI's child got it: the same thread count, the same float sums
    result = subprocess.run([sys.executable, str(ROOT / "launch.py"), "train", "--preset", PRESET,
                             "--set", f"output.path={cli_output}", "--set", f"workspace_dir={tmp_path / 'ws'}"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    gui, cli = load_file(gui_run["output"]), load_file(cli_output)
    assert sorted(gui) == sorted(cli)
    # the preset's layer_preset "attn" reached the trainer from both: no feed-forward layers
    assert not any("_ff_" in key for key in gui) and any("attn1_to_q" in key for key in gui)
    for key in gui:  # equal up to float summation order (thread scheduling), never a different run
        torch.testing.assert_close(gui[key], cli[key], atol=1e-6, rtol=0, msg=key)


def test_stop_stops_and_leaves_a_backup(app, tmp_path):
    app.preset_var.set(PRESET)
    app.load_button.invoke()
    edit(app, "Training", "schedule.epochs", "500")
    edit(app, "General", "workspace_dir", str(tmp_path / "ws"))
    edit(app, "Model", "output.path", str(tmp_path / "out.safetensors"))
    app.start_button.invoke()
    wait_for_event(app, "progress")
    app.command_buttons["sample"].invoke()  # Sample now
    wait_for_event(app, "sample")
    assert app.tabs["Run"].samples
    app.start_button.invoke()  # Stop
    assert app.status_label.cget("text").startswith("Stopping")
    assert run_to_end(app) == 0
    names = [e["event"] for e in app.run_events]
    assert "backup" in names and names[-1] == "finished"
    # a stopped run says so, with where it stopped, and its bars are not full
    assert app.status_label.cget("text").startswith("Stopped at step ")
    assert app.progress.get() < 1.0
    steps = max(e["step"] for e in app.run_events if e["event"] == "progress")
    assert steps < 500 * 2
    backup = Path(next(e["path"] for e in app.run_events if e["event"] == "backup"))
    assert backup.exists() and backup.is_relative_to(tmp_path / "ws" / "backup")


FAKE_RUN = """
import json, sys, time
def emit(**event):
    print(json.dumps(event), flush=True)
emit(event="started", total_steps=2)
if sys.argv[1] == "fail":
    print("Traceback-free log line on stderr", file=sys.stderr, flush=True)
    emit(event="error", message="model.base: /nowhere is not a model folder")
    sys.exit(1)
time.sleep(float(sys.argv[2]))
emit(event="progress", step=1, total_steps=2, epoch=0, epochs=1, loss=0.5, lr=1e-4, it_per_s=1.0, eta_s=1.0)
open(sys.argv[3], "w").write("done")
emit(event="finished")
"""


def fake_run_argv(*args: str) -> list[str]:
    """A child that speaks the run protocol without training (for what the window does with it)."""
    return [sys.executable, "-c", FAKE_RUN, *args]


def test_failed_run_shows_its_error_and_the_window_stays_live(app, monkeypatch):
    app.preset_var.set(PRESET)
    app.load_button.invoke()
    monkeypatch.setattr(app, "run_argv", lambda _config: fake_run_argv("fail"))
    before = len(app.dialogs)
    app.start_button.invoke()
    assert run_to_end(app, timeout=30) == 1
    errors = [e for e in app.run_events if e["event"] == "error"]
    assert len(errors) == 1 and len(app.dialogs) == before + 1
    dialog = app.dialogs[-1]
    assert dialog.winfo_exists() and dialog.message == "model.base: /nowhere is not a model folder"
    assert "Traceback-free log line on stderr" in app.tabs["Run"].log_text()
    assert app.status_label.cget("text") == "Failed (exit code 1): model.base: /nowhere is not a model folder"
    edit(app, "Adapter", "adapter.rank", "5")  # the window still works
    assert app.cfg.data["adapter"]["rank"] == 5
    dialog.destroy()


def test_close_during_run_stops_with_backup_and_config_comes_back(app, home, tmp_path):
    from ui.app import App

    app.preset_var.set(PRESET)
    app.load_button.invoke()
    edit(app, "Training", "schedule.epochs", "500")
    edit(app, "General", "workspace_dir", str(tmp_path / "ws"))
    edit(app, "Adapter", "adapter.rank", "6")
    previous = app.client
    app.start_button.invoke()
    client = app.client
    assert client is not previous, app.refused
    wait_for_event(app, "progress")
    info = app.cfg.machine_info
    asked = []
    app.ask_close = lambda: asked.append(True) or "stop"
    app.on_close()  # what the window manager's close button calls
    assert asked == [True]

    def closed():
        try:
            return not app.winfo_exists()
        except Exception:
            return True

    pump(app, closed, timeout=60, what="the window to close after the stop")
    client.wait(30)
    assert client.returncode == 0
    assert list((tmp_path / "ws" / "backup").iterdir()), "no backup after stop-and-close"
    assert (home / "gui" / "last_config.json").is_file()

    again = App(machine_info=info)
    try:
        pump(again, timeout=0.2)
        assert again.cfg.data["adapter"]["rank"] == 6
        assert again.cfg.data["workspace_dir"] == str(tmp_path / "ws")
        assert again.tabs["Adapter"].fields["adapter.rank"].var.get() == "6"

        # closing again during a run, this time leaving it running: it goes on after the window
        marker = tmp_path / "left-running.txt"
        again.run_argv = lambda _config: fake_run_argv("ok", "3", str(marker))
        assert again.start()
        client = again.client
        pump(again, lambda: any(e["event"] == "started" for e in again.run_events), timeout=30, what="the start")
        again.ask_close = lambda: "leave"
        again.on_close()
        pump(again, lambda: not _exists(again), timeout=5, what="the window to close")
        assert client.process.poll() is None, "the run ended with the window"
        assert client.process.wait(30) == 0
        assert marker.read_text() == "done"
        assert '"event": "finished"' in client.events_path.read_text()
    finally:
        if _exists(again):
            again.destroy()


def _exists(window) -> bool:
    try:
        return bool(window.winfo_exists())
    except Exception:
        return False
