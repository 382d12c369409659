"""Defects found clicking through the GUI (issue 30), each checked in a real window (Xvfb): the
concept preview going empty and back, error dialogs (OK in view, Escape closes), the preset box
naming what is loaded, Reset asking first, the loss plot before and at its first point, the epoch
shown the same in the log and the status line, the mouse wheel over a multi-line box, and the
preset-name dialog placed over the window.

One window serves the module (no `launch.py info` child: the machine info is given)."""

from __future__ import annotations

import io

import pytest

from gui_driver import edit, field, fresh, pump

MACHINE = {"families": {}, "devices": {"cpu": {}}}


@pytest.fixture(scope="module")
def app(display, home):
    from ui.app import App

    window = App(machine_info=MACHINE, restore=False)
    pump(window, timeout=0.2)
    yield window
    try:
        window.destroy()
    except Exception:
        pass


def _concept_text(app) -> str:
    previews = app.tabs["Concepts"].previews
    return previews[0]["count"].cget("text") if previews else ""


def test_concept_preview_survives_a_folder_going_empty_and_back(app, shape_images):
    fresh(app)
    concepts = app.tabs["Concepts"]
    concepts.add()
    app.tabview.set("Concepts")
    for path, shown in ((str(shape_images), "4 images"), ("", "Preview: choose a folder"),
                        (str(shape_images), "4 images")):
        edit(app, "Concepts", "concepts[0].path", path)
        pump(app, lambda: _concept_text(app).startswith(shown), timeout=10, what=f"the preview to say {shown!r}")
        pump(app, timeout=0.1)  # the label's redraw, where a deleted image fails
    for _ in range(3):  # ▶: each image in turn
        concepts.browse(0, 1)
        pump(app, timeout=0.05)
    label = concepts.previews[0]["image"]
    assert str(label._label.cget("image")) in app.image_names()
    assert app.callback_errors == [] and app.dialogs == []


def test_error_dialog_keeps_ok_in_view_and_escape_closes_it(app):
    fresh(app)
    details = "\n".join(f"line {i} of a long traceback" for i in range(200))
    dialog = app.show_error("Training failed", "ValueError: " + "a very long message " * 60, details)
    pump(app, lambda: dialog.winfo_ismapped() and dialog.ok_button.winfo_ismapped(), timeout=5,
         what="the dialog and its OK button")
    pump(app, timeout=0.2)
    scale = dialog._get_window_scaling()
    assert (dialog.winfo_width(), dialog.winfo_height()) == (round(620 * scale), round(300 * scale))
    ok = dialog.ok_button
    bottom = ok.winfo_rooty() + ok.winfo_height()
    assert ok.winfo_rooty() >= dialog.winfo_rooty() and bottom <= dialog.winfo_rooty() + dialog.winfo_height()
    # centred over the main window
    centre = dialog.winfo_rootx() + dialog.winfo_width() // 2
    assert abs(centre - (app.winfo_rootx() + app.winfo_width() // 2)) <= 20
    pump(app, lambda: app.focus_get() is not None and app.focus_get().winfo_toplevel() is dialog, timeout=5,
         what="the dialog to take the focus")
    app.focus_get().event_generate("<Escape>")
    pump(app, lambda: not dialog.winfo_exists(), timeout=5, what="Escape to close the dialog")


def test_preset_box_names_the_loaded_preset_and_none_at_first(app, home):
    from modules.config.presets import list_presets
    from ui.app import App
    from ui.preset_bar import NO_PRESET

    fresh(app)
    assert app.preset_var.get() == NO_PRESET  # a new window loaded no preset
    app.load_button.invoke()  # Load with nothing chosen: says so, changes nothing
    assert app.status_label.cget("text").startswith("Choose a preset")
    name = next(p.name for p in list_presets() if p.builtin and p.family == "sdxl")
    app.preset_var.set(name)
    app.load_button.invoke()
    pump(app, timeout=0.1)
    assert app.preset_var.get() == name and app.cfg.get("model.family") == "sdxl"
    app.save_last_config()
    app.save_settings()
    again = App(machine_info=MACHINE)  # restores the last config: the box names its preset
    try:
        pump(again, timeout=0.1)
        assert again.preset_var.get() == name
    finally:
        again.destroy()
    app.ask_reset = lambda lost: True
    app.reset_defaults()  # a reset config came from no preset
    assert app.preset_var.get() == NO_PRESET


def test_reset_asks_before_clearing_the_model_concepts_and_prompts(app, shape_images):
    fresh(app)
    asked = []
    app.ask_reset = lambda lost: asked.append(lost) or False
    app.reset_button.invoke()
    assert asked == []  # nothing of the user's to lose: no question
    base = str(shape_images.parent / "some-model")  # any path: only what Reset would clear matters
    edit(app, "Model", "model.base", base)
    app.tabs["Concepts"].add(str(shape_images))
    app.tabs["Sampling"].add("a red circle")
    edit(app, "Adapter", "adapter.rank", "5")
    app.reset_button.invoke()
    assert asked == [["the base model", "1 concept", "1 prompt"]]
    assert app.cfg.get("model.base") == base and app.cfg.get("adapter.rank") == 5
    assert app.status_label.cget("text") == "Reset cancelled."
    app.ask_reset = lambda lost: asked.append(lost) or True
    app.reset_button.invoke()
    pump(app, timeout=0.05)
    assert len(asked) == 2 and app.cfg.get("model.base") in ("", None) and app.cfg.get("concepts") == []
    assert field(app, "Adapter", "adapter.rank").var.get() == "16"


def test_loss_plot_says_what_comes_before_the_first_step_and_draws_one_point(app):
    fresh(app)
    run = app.tabs["Run"]
    run.clear()
    pump(app, timeout=0.05)
    assert not run.axes.get_visible() and run.placeholder.get_visible()
    run.add_loss(1, 0.5)
    pump(app, lambda: run._redraw_job is None and run.steps == [1], timeout=5, what="the redraw")
    assert run.axes.get_visible() and not run.placeholder.get_visible()
    assert run.line.get_marker() == "o"  # one point: a dot, not an invisible line
    low, high = run.axes.get_xlim()
    assert low < 1 < high
    run.add_loss(2, 0.4)
    pump(app, lambda: run._redraw_job is None and run.steps == [1, 2], timeout=5, what="the redraw")
    assert run.line.get_marker() in ("", "None")
    run.clear()


def test_epoch_reads_the_same_in_the_log_and_the_status_line(app):
    from modules.cli.console import ConsoleCallbacks
    from modules.trainer.callbacks import Progress

    event = {"event": "progress", "step": 1, "total_steps": 60, "epoch": 0, "epochs": 30, "loss": 0.5,
             "lr": 1e-4, "it_per_s": 1.0, "eta_s": 10.0}
    app._event(event)
    assert "epoch 1/30" in app.status_label.cget("text")
    stream = io.StringIO()
    progress = {k: v for k, v in event.items() if k != "event"}
    ConsoleCallbacks(stream).on_progress(Progress(**progress))
    assert "epoch 1/30" in stream.getvalue(), stream.getvalue()
    app.run_events.clear()


def test_mouse_wheel_over_a_multiline_box_scrolls_the_page(app):
    fresh(app)
    tab, box = next((name, f) for name, t in app.tabs.items() for f in getattr(t, "fields", {}).values()
                    if f.widget_kind == "lines")
    app.tabview.set(tab)
    pump(app, timeout=0.3)
    page = app.tabs[tab]
    canvas = page._parent_canvas
    assert canvas.yview() != (0.0, 1.0), f"the {tab} tab does not scroll at this size"
    canvas.yview_moveto(0)
    pump(app, timeout=0.05)
    inner = box.input._textbox
    inner.event_generate("<Button-5>", x=5, y=5)
    pump(app, timeout=0.05)
    assert canvas.yview()[0] > 0, "the wheel over the box did not scroll the page"
    inner.event_generate("<Button-4>", x=5, y=5)
    pump(app, timeout=0.05)
    assert canvas.yview()[0] == 0


def test_preset_name_dialog_opens_over_the_window(app):
    from modules.config.presets import user_presets_dir

    fresh(app)
    seen = {}

    def answer():
        dialog = getattr(app, "name_dialog", None)
        if dialog is None or not dialog.winfo_exists() or not hasattr(dialog, "_entry") or not dialog.winfo_ismapped():
            app.after(50, answer)
            return
        if "x" not in seen:  # give the dialog a moment to be placed
            seen["x"] = None
            app.after(300, answer)
            return
        seen["x"] = dialog.winfo_rootx() + dialog.winfo_width() // 2
        seen["y"] = dialog.winfo_rooty()
        dialog._entry.insert(0, "placed dialog preset")
        dialog._ok_event()

    app.after(50, answer)
    path = app.save_as_button.invoke()
    assert path is not None and path == user_presets_dir() / "placed dialog preset.json"
    assert abs(seen["x"] - (app.winfo_rootx() + app.winfo_width() // 2)) <= 20
    assert seen["y"] > app.winfo_rooty() + 40
    assert app.preset_var.get() == "placed dialog preset"


STAGED_RUN = """
import json, os, sys, time
def wait(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
def emit(**event):
    print(json.dumps(event), flush=True)
print("[loading model]", file=sys.stderr, flush=True)
print("[caching latents and text]", file=sys.stderr, flush=True)
wait(sys.argv[1])
emit(event="started", total_steps=2)
emit(event="progress", step=1, total_steps=2, epoch=0, epochs=1, loss=0.5, lr=1e-4, it_per_s=1.0, eta_s=1.0)
wait(sys.argv[2])
emit(event="finished")
"""


def test_status_line_names_the_stage_before_the_first_step(app, tmp_path, monkeypatch):
    import sys

    from gui_driver import run_to_end

    fresh(app)
    cached, ended = tmp_path / "cached", tmp_path / "ended"
    monkeypatch.setattr(app.cfg, "start_problems", lambda: [])  # the child below trains nothing
    monkeypatch.setattr(app, "run_argv", lambda _config: [sys.executable, "-c", STAGED_RUN, str(cached), str(ended)])
    assert app.start()
    pump(app, lambda: app.status_label.cget("text").startswith("Caching latents and text… "), timeout=30,
         what="the caching stage in the status line")
    assert app.progress.cget("mode") == "indeterminate"  # alive, length unknown
    cached.touch()
    pump(app, lambda: app.status_label.cget("text").startswith("step 1/2"), timeout=30, what="the first step")
    assert app.progress.cget("mode") == "determinate" and app.progress.get() == pytest.approx(0.5)
    ended.touch()
    assert run_to_end(app, timeout=30) == 0
    assert app.status_label.cget("text") == "Finished."


def test_top_bar_names_the_adapter_and_one_family_name(app):
    from ui.app import family_menu_text

    fresh(app)
    pump(app, timeout=0.05)
    assert app.family_menu.get() == family_menu_text("sd15") and "(sd15)" in app.family_menu.get()
    assert field(app, "Model", "model.family").var.get() == "sd15"
    assert app.method_menu.cget("state") == "normal" and app.method_note.cget("text") == ""
    edit(app, "Training", "method.type", "fine_tune")
    pump(app, timeout=0.05)
    assert app.cfg.get("method.type") == "fine_tune"
    assert app.method_menu.cget("state") == "disabled" and "fine_tune" in app.method_note.cget("text")


def test_flux_without_a_preset_plans_its_weights_and_hides_what_it_does_not_use(app):
    fresh(app)
    app.tabs["Sampling"].add("a cat")
    app._family_chosen("FLUX.1")  # what picking it in the selector calls
    pump(app, timeout=0.1)
    assert app.cfg.get("model.family") == "flux"
    parts = app.cfg.data["model"]["parts"]
    assert parts and {p["weight_dtype"] for p in parts.values()} == {"auto"}, parts
    assert parts["transformer"]["train"] is True  # the family's own train defaults stay
    app.tabview.set("Sampling")
    pump(app, timeout=0.1)
    assert not field(app, "Sampling", "sampling.scheduler").shown
    assert not field(app, "Sampling", "sampling.prompts[0].negative_prompt").shown
    assert field(app, "Sampling", "sampling.prompts[0].prompt").shown
    app._family_chosen("Stable Diffusion 1.5")
    pump(app, timeout=0.1)
    assert field(app, "Sampling", "sampling.scheduler").shown
    assert field(app, "Sampling", "sampling.prompts[0].negative_prompt").shown
    assert app.cfg.config is not None, app.cfg.problems  # "auto" weights are a valid config


def test_ui_scale_round_trip_keeps_layout_and_place_and_the_tensorboard_button(app, tmp_path, monkeypatch):
    """Last in the file: it changes the scale (and back)."""
    fresh(app)
    app.tabs["Concepts"].add(str(tmp_path))
    app.geometry("900x600+40+30")
    for name in ("Backup", "Concepts"):  # each shown once, so both are built and laid out (ui/lazy_tabs.py)
        app.tabview.set(name)
        pump(app, timeout=0.3)
    before = (app.tabs["Concepts"].winfo_reqheight(), app.tabs["Backup"].winfo_reqheight())
    place = app.geometry().split("+", 1)[1]

    # the TensorBoard URL has its own place: the next progress line does not replace it
    (tmp_path / "ws" / "tensorboard").mkdir(parents=True)
    edit(app, "General", "workspace_dir", str(tmp_path / "ws"))
    monkeypatch.setattr(app.tensorboard, "open", lambda folder: "http://127.0.0.1:6006/")
    assert app.open_tensorboard() == "http://127.0.0.1:6006/"
    app._event({"event": "progress", "step": 1, "total_steps": 9, "epoch": 0, "epochs": 3, "loss": 0.1})
    assert app.tensorboard_url.cget("text") == "http://127.0.0.1:6006/"
    assert app.status_label.cget("text").startswith("step 1/9")

    app.set_ui_scale("150%")
    pump(app, timeout=0.5)
    app.set_status("a long status line " * 20)
    pump(app, timeout=0.3)
    button = app.tensorboard_button
    assert button.winfo_ismapped() and button.winfo_width() >= round(100 * 1.5) - 2
    assert button.winfo_rootx() + button.winfo_width() <= app.winfo_rootx() + app.winfo_width()

    app.set_ui_scale("100%")
    pump(app, timeout=0.5)
    for name in ("Concepts", "Backup"):
        app.tabview.set(name)
        pump(app, timeout=0.2)
    after = (app.tabs["Concepts"].winfo_reqheight(), app.tabs["Backup"].winfo_reqheight())
    assert after == before, "the tabs kept the 150% spacing"
    assert app.geometry().split("+", 1)[1] == place
    app.run_events.clear()
    assert app.callback_errors == []


def test_dataset_tool_edits_a_caption_in_place_filters_and_bulk_edits(app, shape_images, tmp_path):
    import shutil

    from ui.dataset_tool import edited

    folder = tmp_path / "concept"
    shutil.copytree(shape_images, folder)
    fresh(app)
    app.tabs["Concepts"].add(str(folder))
    pump(app, timeout=0.1)
    tool = app.tabs["Concepts"].open_dataset_tool(0)  # the concept's "Captions…" button
    try:
        pump(app, lambda: tool.winfo_ismapped(), timeout=5, what="the dataset tool")
        images = sorted(p for p in folder.iterdir() if p.suffix == ".png")
        assert list(tool.rows) == images and tool.count_label.cget("text") == "4 of 4 images"
        assert tool.stats.cget("text") == "Sizes 64x64: 4; 0 without a caption."
        first = images[0]
        box = tool.rows[first]["box"]
        box.delete("1.0", "end")
        box.insert("1.0", "a hand-written caption")
        box._textbox.event_generate("<FocusOut>")  # leaving the box saves it
        pump(app, timeout=0.05)
        assert first.with_suffix(".txt").read_text() == "a hand-written caption\n"
        assert not list(folder.glob("*.tmp*"))  # written atomically: no temp file left

        tool.filter_var.set("hand-written")
        pump(app, timeout=0.05)
        assert list(tool.rows) == [first] and tool.count_label.cget("text") == "1 of 4 images"
        tool.filter_var.set("")
        tool.select_shown()
        tool.edit_var.set("add tag")
        tool.text_var.set("sks")
        assert tool.apply_bulk() == 4
        assert first.with_suffix(".txt").read_text() == "a hand-written caption, sks\n"
        tool.edit_var.set("remove tag")
        assert tool.apply_bulk() == 4
        assert first.with_suffix(".txt").read_text() == "a hand-written caption\n"
        assert edited("a, b", "prefix", "x ") == "x a, b" and edited("a b", "replace", "a", "c") == "c b"
    finally:
        tool.destroy()
    pump(app, timeout=0.5)
    preview = app.tabs["Concepts"].previews[0]
    pump(app, lambda: "hand-written" in preview["caption"].cget("text") or _browse_to_first(app), timeout=5,
         what="the preview to show the edited caption")
    assert app.callback_errors == []


def _browse_to_first(app) -> bool:
    app.tabs["Concepts"].browse(0, 1)
    return False


def test_a_caption_edited_in_the_tool_is_the_only_one_the_next_run_encodes_again(app, tiny_model, shape_images,
                                                                                   tmp_path):
    import shutil

    from conftest import train_config
    from modules.trainer.generic_trainer import GenericTrainer
    from ui.dataset_tool import DatasetTool

    folder = tmp_path / "concept"
    shutil.copytree(shape_images, folder)
    config = train_config(tiny_model, folder, tmp_path)
    first = GenericTrainer(config)
    first.start()
    assert first.dataset.cache_stats["text"] == (0, 4)
    first.lock.release()
    tool = DatasetTool(app, folder)
    try:
        assert tool.save(tool.images[0], "a caption from the dataset tool")
    finally:
        tool.destroy()
    second = GenericTrainer(config)
    second.start()
    second.lock.release()
    assert second.dataset.cache_stats["text"] == (3, 1)  # (reused, encoded): that caption only
    assert second.dataset.cache_stats["latents"][1] == 0
