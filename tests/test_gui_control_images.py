"""Control images per sample prompt in the window (issue 29 item 2): the prompt editor's picker for a
family whose prompts take them (Pick images…, a thumbnail and a remove per image, a missing file named
in red, at most the family's number), hidden for a family that takes none; the Run tab's gallery shows
a sample's control images beside it, from its `sample` event or the run's prompt list."""

from __future__ import annotations

import pytest

from gui_driver import pump


@pytest.fixture(scope="module")
def app(display, home):
    from ui.app import App

    window = App(machine_info={"families": {}, "devices": {"cpu": {}}}, restore=False)
    pump(window, timeout=0.2)
    yield window
    window.destroy()


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    from PIL import Image

    folder = tmp_path_factory.mktemp("controls")
    paths = []
    for name, colour in (("red.png", "red"), ("green.png", "green"), ("blue.png", "blue"), ("white.png", "white")):
        Image.new("RGB", (40, 24), colour).save(folder / name)
        paths.append(str(folder / name))
    return paths


def prompt_for(app, family: str):
    """A prompt in the Sampling tab of a config of `family`; its control images' Field."""
    from ui.state import default_data

    data = default_data(family)
    data["sampling"]["prompts"] = [{"prompt": "make it night"}]
    app.cfg.load(data)
    app.tabview.set("Sampling")
    pump(app, timeout=0.1)
    return app.tabs["Sampling"].fields["sampling.prompts[0].control_images"]


def test_the_picker_takes_images_shows_thumbnails_and_removes_one(app, pictures, monkeypatch):
    field = prompt_for(app, "flux2")  # FLUX.2 takes up to 4 references
    picker = field.input
    assert field.is_visible() and field.winfo_manager() == "pack"
    assert picker.pick_button.cget("text") == "Pick images…" and "up to 4" in picker.hint.cget("text")
    asked = []
    monkeypatch.setattr("ui.image_list.filedialog.askopenfilenames",
                        lambda **options: asked.append(options) or tuple(pictures[:2]))
    picker.pick_button.invoke()
    pump(app, timeout=0.1)
    assert asked and asked[0]["parent"] is picker
    assert app.cfg.get("sampling.prompts[0].control_images") == pictures[:2]
    assert app.cfg.config.sampling.prompts[0].control_images == pictures[:2]
    assert len(picker.pictures) == 2 and picker.missing == []
    thumbs = [c for cell in picker.cells.winfo_children() for c in cell.winfo_children() if c.cget("image")]
    assert len(thumbs) == 2 and all(t.winfo_ismapped() for t in thumbs)
    removes = [c for cell in picker.cells.winfo_children() for c in cell.winfo_children() if hasattr(c, "invoke")]
    assert [r.cget("text") for r in removes] == ["x", "x"]
    removes[0].invoke()  # the red one goes
    pump(app, timeout=0.1)
    assert app.cfg.get("sampling.prompts[0].control_images") == pictures[1:2]
    assert len(picker.pictures) == 1 and len(picker.cells.winfo_children()) == 1
    # a file that went away: named in red, and the field says so (as the run's preflight would)
    app.cfg.set("sampling.prompts[0].control_images", [pictures[1], "/nowhere/gone.png"])
    pump(app, timeout=0.1)
    assert picker.missing == ["/nowhere/gone.png"]
    labels = [c.cget("text") for cell in picker.cells.winfo_children() for c in cell.winfo_children()]
    assert "missing:\ngone.png" in labels
    assert "/nowhere/gone.png not found" in field.error_text
    assert app.callback_errors == []


def test_a_family_that_takes_one_image_keeps_one(app, pictures, monkeypatch):
    field = prompt_for(app, "flux_kontext")  # FLUX.1 Kontext conditions on one reference image
    monkeypatch.setattr("ui.image_list.filedialog.askopenfilenames", lambda **_: tuple(pictures[:2]))
    field.input.pick_button.invoke()
    pump(app, timeout=0.1)
    assert app.cfg.get("sampling.prompts[0].control_images") == pictures[:1]
    assert "left out green.png" in field.input.hint.cget("text")
    monkeypatch.setattr("ui.image_list.filedialog.askopenfilenames", lambda **_: (pictures[2],))
    field.input.pick_button.invoke()  # a new pick replaces the one
    pump(app, timeout=0.1)
    assert app.cfg.get("sampling.prompts[0].control_images") == pictures[2:3]
    assert field.error_text == ""


def test_a_pick_stops_at_the_most_the_family_takes(app, pictures, monkeypatch):
    field = prompt_for(app, "qwen_image_edit_plus")  # Qwen-Image-Edit-2509 takes up to 3
    field.input.add(pictures[:2])
    monkeypatch.setattr("ui.image_list.filedialog.askopenfilenames", lambda **_: tuple(pictures[2:]))
    field.input.pick_button.invoke()
    pump(app, timeout=0.1)
    assert app.cfg.get("sampling.prompts[0].control_images") == pictures[:3]  # in the order picked
    assert "left out white.png" in field.input.hint.cget("text")
    assert field.input.pick_button.cget("state") == "disabled" and field.error_text == ""


def test_a_family_whose_prompts_take_no_images_shows_no_picker(app, pictures):
    field = prompt_for(app, "sd15")
    assert not field.is_visible() and not field.winfo_ismapped()
    # the family changes (the selector): the picker comes, and goes again
    app._family_chosen("FLUX.1 Kontext")
    pump(app, timeout=0.1)
    field = app.tabs["Sampling"].fields["sampling.prompts[0].control_images"]
    assert field.is_visible() and field.winfo_manager() == "pack"
    assert "FLUX.1 Kontext" in field.input.hint.cget("text")
    field.input.add(pictures[:1])
    pump(app, timeout=0.05)
    app._family_chosen("Stable Diffusion 1.5")
    pump(app, timeout=0.1)
    field = app.tabs["Sampling"].fields["sampling.prompts[0].control_images"]
    # a prompt that still holds one: shown, with why it cannot stay, so that it can be removed
    assert field.is_visible() and "takes none" in field.error_text
    field.input.remove(0)
    pump(app, timeout=0.1)
    assert not field.is_visible() and not field.winfo_ismapped()


def test_the_gallery_shows_a_samples_control_images_beside_it(app, pictures, tmp_path):
    from PIL import Image

    from modules.sampling.video_writer import write_sample_video
    from ui.run_history import sample_info

    still = tmp_path / "step0000002-0.png"
    Image.new("RGB", (32, 32), "white").save(still)
    plain = tmp_path / "step0000002-1.png"
    Image.new("RGB", (32, 32), "black").save(plain)
    _video, poster = write_sample_video(tmp_path / "step0000002-2", [Image.new("RGB", (32, 16), "gray")] * 3, 50.0)
    app.run_config = {"sampling": {"prompts": [{"prompt": "night", "control_images": [pictures[0]]},
                                               {"prompt": "plain"}, {"prompt": "a video"}]}}
    app.run_events = []
    run_tab = app.tabs["Run"]
    run_tab.clear()
    # as a run reports them: the first with its prompt's control image, the video with the event's own
    app._event({"event": "sample", "path": str(still), "control_images": [pictures[0]]})
    app._event({"event": "sample", "path": str(plain)})
    app._event({"event": "sample", "path": str(poster), "control_images": [pictures[2], "/nowhere/gone.png"]})
    pump(app, timeout=0.1)
    assert run_tab.controls_shown == {str(still): [pictures[0]], str(poster): [pictures[2], "/nowhere/gone.png"]}

    def texts(widget):
        for child in widget.winfo_children():
            if child.winfo_class() == "CTkLabel" or hasattr(child, "_label"):
                yield child.cget("text")
            yield from texts(child)

    shown = list(texts(run_tab.gallery))
    assert shown.count("control") == 2 and "missing:\ngone.png" in shown
    # the control column sits left of its sample, in the same cell
    cell = next(c for c in run_tab.gallery.winfo_children() if "control" in list(texts(c)) and
                "step 2: night" in list(texts(c)))
    column, sample = cell.winfo_children()[:2]
    app.tabview.set("Run")
    pump(app, lambda: sample.winfo_ismapped(), timeout=5, what="the gallery on screen")
    assert column.winfo_rootx() < sample.winfo_rootx()
    # an older run's events said no control images: read from its prompt list
    run_tab.clear()
    run_tab.add_sample(str(still), sample_info(str(still), app.run_config))
    assert run_tab.controls_shown[str(still)] == [pictures[0]]
    run_tab.clear()
    assert app.callback_errors == []


def test_the_sample_event_carries_its_prompts_control_images():
    import io
    import json

    from modules.cli.console import ConsoleCallbacks
    from modules.remote.cli import dispatch
    from modules.trainer.callbacks import FanOut
    from modules.trainer.event_protocol import JsonlEvents

    stream, log = io.StringIO(), io.StringIO()
    events = FanOut(JsonlEvents(stream), ConsoleCallbacks(log))
    events.on_sample("/ws/samples/step0000002-0.png", control_images=["/in/night.png"])
    events.on_sample("/ws/samples/step0000002-1.png")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines == [{"event": "sample", "path": "/ws/samples/step0000002-0.png", "control_images": ["/in/night.png"]},
                     {"event": "sample", "path": "/ws/samples/step0000002-1.png"}]
    assert "(from /in/night.png)" in log.getvalue()
    relayed = io.StringIO()  # a remote run's events, relayed to this machine's protocol as they came
    for line in lines:
        dispatch(line, JsonlEvents(relayed))
    assert [json.loads(line) for line in relayed.getvalue().splitlines()] == lines
