"""The desktop GUI in a real window (Xvfb when no DISPLAY is set): tabs, binding and validation,
runs started from the window as child processes, presets through the preset bar, and the GUI and
`launch.py train` training the same adapter from the same preset.

One App serves the whole module (tests run in file order); the last test closes it during a run
and opens a new one to check that the last config comes back. The window drivers are in
tests/gui_driver.py; the display and home fixtures in conftest.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gui_driver import (
    TABS, configure_tiny_run, edit, fake_run_argv, field, fresh, pump, run_to_end, screenshot, type_text, wait_for_event,
)

ROOT = Path(__file__).resolve().parents[1]


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
    from modules.config.families import family_names, get_family_class

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
    from modules.config.presets import user_presets_dir

    fresh(app)
    configure_tiny_run(app, tiny_model, shape_images, tmp_path_factory.mktemp("gui-run"))
    monkeypatch.setattr(app, "ask_preset_name", lambda: PRESET)  # the "Save as…" dialog, answered
    monkeypatch.setattr(app, "ask_reset", lambda lost: True)  # "Reset to the defaults?", answered yes
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
    # the measured memory after step 2 (a CPU run: the host's), one event, on the Run tab
    memory = [e for e in gui_run["events"] if e["event"] == "memory"]
    assert [e["step"] for e in memory] == [2]
    assert run_tab.memory_line.cget("text").startswith("Memory after step 2: host peak ")
    assert run_tab.memory_line.winfo_ismapped()
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


# A run that trains nothing and ends only on the window's stop command, writing a backup then (what
# the trainer does on that command: test_stop_stops_and_leaves_a_backup above, through the same
# App.stop); ended any other way (stdin closed, killed) it leaves no backup.
STOPPED_ONLY_BY_COMMAND = """
import json, os, sys
def emit(**event):
    print(json.dumps(event), flush=True)
emit(event="started", total_steps=1000)
emit(event="progress", step=1, total_steps=1000, epoch=0, epochs=500, loss=0.5, lr=1e-4, it_per_s=1.0, eta_s=1.0)
for line in sys.stdin:
    if json.loads(line).get("command") == "stop":
        backup = os.path.join(sys.argv[1], "backup", "step0000001")
        os.makedirs(backup)
        open(os.path.join(backup, "state.pt"), "wb").close()
        emit(event="backup", path=backup)
        emit(event="finished")
        sys.exit(0)
sys.exit(1)
"""


def test_close_during_run_stops_with_backup_and_config_comes_back(app, home, tmp_path, monkeypatch):
    from ui.app import App

    app.preset_var.set(PRESET)
    app.load_button.invoke()
    edit(app, "Training", "schedule.epochs", "500")
    edit(app, "General", "workspace_dir", str(tmp_path / "ws"))
    edit(app, "Adapter", "adapter.rank", "6")
    # what closing does to a run (send stop, wait for its end, then close): a child of the protocol,
    # not a second real training beside the stop test's
    monkeypatch.setattr(app, "run_argv", lambda _config: [sys.executable, "-c", STOPPED_ONLY_BY_COMMAND,
                                                           str(tmp_path / "ws")])
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
        go_on = tmp_path / "go-on"
        again.run_argv = lambda _config: fake_run_argv("ok", str(go_on), str(marker))
        assert again.start()
        client = again.client
        pump(again, lambda: any(e["event"] == "started" for e in again.run_events), timeout=30, what="the start")
        again.ask_close = lambda: "leave"
        again.on_close()
        pump(again, lambda: not _exists(again), timeout=5, what="the window to close")
        assert client.process.poll() is None, "the run ended with the window"
        go_on.touch()
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
