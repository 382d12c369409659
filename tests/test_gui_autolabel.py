"""The dataset tool's "Auto-caption…" and "Generate masks…" dialogs in a real window (Xvfb), with
the tiny BLIP and CLIPSeg (modules/autolabel/tiny_models.py): each runs `launch.py caption` /
`launch.py mask` as a child process, shows its progress, stops on request, and the tool's rows
read the captions and masks again when it ends; the window stays live all along."""

from __future__ import annotations

import shutil
import time

import pytest

from gui_driver import fresh, pump

MACHINE = {"families": {}, "devices": {"cpu": {}}}
BUTTON1 = 1 << 8  # X's Button1Mask: a motion with the left button held


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


def run_dialog(app, dialog, timeout: float = 90) -> float:
    """Pump the window until the dialog's run ends; the longest the window went without events."""
    import tkinter

    longest, deadline = 0.0, time.monotonic() + timeout
    while dialog.client is None or dialog.client.returncode is None or dialog.start_button.cget("state") != "normal":
        began = time.monotonic()
        try:
            app.update()
        except tkinter.TclError:
            pass
        longest = max(longest, time.monotonic() - began)
        assert time.monotonic() < deadline, f"the run did not end: {dialog.events}, log {dialog.log[-5:]}"
        time.sleep(0.02)
    pump(app, timeout=0.1)
    return longest


def test_auto_caption_runs_in_the_background_stops_and_refreshes_the_rows(app, shape_images, tiny_labellers, tmp_path):
    from ui.label_dialog import CAPTION, MASKS

    folder = tmp_path / "concept"
    shutil.copytree(shape_images, folder)
    images = sorted(folder.glob("*.png"))
    for image in images[1:]:
        image.with_suffix(".txt").unlink()
    kept = images[0].with_suffix(".txt").read_text()
    fresh(app)
    app.tabs["Concepts"].add(str(folder))
    pump(app, timeout=0.1)
    tool = app.tabs["Concepts"].open_dataset_tool(0)
    try:
        pump(app, lambda: tool.winfo_ismapped(), timeout=5, what="the dataset tool")
        assert tool.stats.cget("text").endswith("; 3 without a caption.")
        dialog = tool.open_label_dialog(CAPTION)
        pump(app, lambda: dialog.winfo_ismapped(), timeout=5, what="the auto-caption dialog")
        dialog.model_var.set("")
        dialog.start()
        assert dialog.client is None and dialog.status.cget("text") == "Choose the model folder first."
        dialog.model_var.set(str(tmp_path / "no-model"))  # the child's one-line error, shown in the dialog
        dialog.start()
        run_dialog(app, dialog)
        assert dialog.status.cget("text") == f"--model: {tmp_path / 'no-model'} is not a folder"
        dialog.model_var.set(str(tiny_labellers("blip")))
        dialog.vars["--batch-size"].set("2")
        dialog.vars["--max-new-tokens"].set("4")
        assert dialog.vars["--mode"].get() == "skip-existing"

        dialog.start()  # and Stop once it has started: before its first batch or while the model loads for it
        pump(app, lambda: any(e["event"] == "started" for e in dialog.events), timeout=60, what="the started event")
        dialog.stop()
        run_dialog(app, dialog)
        written = [image for image in images[1:] if image.with_suffix(".txt").exists()]
        assert written in (images[1:1], images[1:3])  # one batch of two at most
        assert f"stopped after {1 + len(written)} of 4 images" in dialog.status.cget("text")  # (one kept)
        assert all(tool.captions[image] for image in written) and not tool.captions[images[3]]

        dialog.start()  # again: skip-existing goes on where the stopped run ended
        longest = run_dialog(app, dialog)
        assert longest < 1.0, f"the window went {longest:.2f} s without handling events"
        assert dialog.status.cget("text").startswith(f"{3 - len(written)} captions written, {1 + len(written)} kept, "
                                                     "0 failed."), dialog.status.cget("text")
        assert dialog.bar.get() == 1.0
        assert images[0].with_suffix(".txt").read_text() == kept
        for image in images:  # the rows show what the child wrote
            written = image.with_suffix(".txt").read_text().strip()
            assert written and tool.captions[image] == written
            assert tool.rows[image]["box"].get("1.0", "end-1c") == written
        assert tool.stats.cget("text").endswith("; 0 without a caption.")
        dialog.destroy()

        from modules.data.masks import load_mask, mask_path

        masks = tool.open_label_dialog(MASKS)
        masks.model_var.set(str(tiny_labellers("clipseg")))
        masks.vars["--prompt"].set("a circle")
        masks.vars["--threshold"].set("0.3")
        masks.start()
        run_dialog(app, masks)
        assert masks.status.cget("text").startswith("4 masks written"), masks.status.cget("text")
        for image in images:
            assert mask_path(image) == image.with_name(f"{image.stem}-masklabel.png")
            assert load_mask(mask_path(image), 64, 64).shape == (1, 64, 64)
        assert list(tool.rows) == images  # masks are not listed as images, but named on their image's row
        for image in images:
            assert tool.rows[image]["name"].cget("text") == f"{image.name}   (mask: {image.stem}-masklabel.png)"
        masks.destroy()
    finally:
        tool.destroy()
    pump(app, timeout=0.2)
    assert app.callback_errors == []


def trains_with_the_painted_mask(folder, image, model, tmp_path) -> None:
    """A run with masked_loss on the folder weights the painted image's loss by that mask on the
    latent grid (the eraser's band at unmasked_weight, the rest 1) and steps."""
    import torch

    from conftest import train_config
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(model, folder, tmp_path, {"concepts": [{"path": str(folder), "masked_loss": True,
                                                                  "unmasked_weight": 0.25}],
                                                    "schedule": {"max_steps": 1, "batch_size": 1}})
    trainer = GenericTrainer(config, TrainCallbacks())
    trainer.start()
    index = next(i for i, entry in enumerate(trainer.dataset.entries) if entry.item.image == image)
    weights = trainer.dataset.collate([index], torch.device("cpu")).masks[0, 0]  # the tiny VAE: 2 px a latent
    assert weights.shape == (32, 32) and ((weights >= 0.25) & (weights <= 1)).all()
    assert torch.allclose(weights[2, :12], torch.tensor(0.25))  # the eraser's band (image rows 3-5)
    assert (weights[4:] == 1).all() and (weights[0] == 1).all()  # above and below it: trained in full
    trainer.train()
    trainer.end()
    assert trainer.step == 1 and trainer.last_loss == trainer.last_loss  # (a number, not NaN)


def test_a_mask_painted_by_hand_is_saved_and_trained_with_masked_loss(app, shape_images, tiny_model, tmp_path):
    import numpy as np

    from modules.data.masks import load_mask, mask_path
    from ui.dataset_tool import DatasetTool

    folder = tmp_path / "concept"
    shutil.copytree(shape_images, folder)
    images = sorted(folder.glob("*.png"))
    tool = DatasetTool(app, folder)
    try:
        tool.rows[images[0]]["paint"].invoke()  # the row's "Mask…"
        painter = tool.painter
        pump(app, lambda: painter.winfo_ismapped(), timeout=5, what="the mask painter")
        assert painter.scale == 8  # a 64-px image shown at 512 px
        canvas = painter.canvas
        painter.tool_var.set("eraser")  # black: a stroke across the top rows, from (0, 4) to (63, 4) in the image
        painter.size_var.set(4)
        canvas.event_generate("<ButtonPress-1>", x=0, y=32)
        canvas.event_generate("<B1-Motion>", x=300, y=32, state=BUTTON1)
        canvas.event_generate("<B1-Motion>", x=511, y=32, state=BUTTON1)
        canvas.event_generate("<ButtonRelease-1>", x=511, y=32)
        painter.size_var.set(2)
        painter.tool_var.set("brush")
        canvas.event_generate("<ButtonPress-1>", x=256, y=32)  # a white dot back in the black band
        canvas.event_generate("<ButtonRelease-1>", x=256, y=32)
        pump(app, timeout=0.1)
        assert painter.changed
        painter.save()
        pump(app, timeout=0.1)
        mask = np.asarray(load_mask(mask_path(images[0]), 64, 64)[0])
        assert mask_path(images[0]) == folder / f"{images[0].stem}-masklabel.png"
        assert (mask[3:6, :28] == 0).all() and (mask[3:6, 36:] == 0).all()  # the eraser's band (4 px wide)
        assert (mask[4, 31:34] == 1).all() and (mask[3:6, 32] == 1).all()  # the brush's dot in it
        assert (mask[10:] == 1).all()  # the rest untouched: white
        assert "(mask: " in tool.rows[images[0]]["name"].cget("text")
        trains_with_the_painted_mask(folder, images[0], tiny_model, tmp_path)

        painter.tool_var.set("fill")  # right button: the white area under the click becomes black
        canvas.event_generate("<ButtonPress-3>", x=256, y=400)
        canvas.event_generate("<ButtonRelease-3>", x=256, y=400)
        painter.save()
        mask = np.asarray(load_mask(mask_path(images[0]), 64, 64)[0])
        assert (mask[10:] == 0).all() and mask[4, 32] == 1  # the dot is not connected to it
        painter.destroy()
    finally:
        tool.destroy()
    pump(app, timeout=0.2)
    assert app.callback_errors == []


def test_a_hub_model_is_downloaded_from_the_dialog_only_after_its_size_is_shown(app, shape_images, tmp_path,
                                                                                monkeypatch):
    """The model field takes a hub id; Download… lists it (size shown, nothing fetched), the button
    then says the size and fetches it on a second press, and the field becomes the folder."""
    from fake_hub import FakeHub

    from modules.autolabel.tiny_models import make_tiny_wd14
    from ui.label_dialog import CAPTION

    tagger = make_tiny_wd14(tmp_path / "tagger")
    files = {p.relative_to(tagger).as_posix(): p.read_bytes() for p in tagger.rglob("*") if p.is_file()}
    hub = FakeHub({"someone/tagger": files})
    monkeypatch.setenv("HF_ENDPOINT", hub.url)  # the dialog's child processes inherit these
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("DIFFTRAINER_HOME", str(tmp_path / "home"))
    fresh(app)
    app.tabs["Concepts"].add(str(shape_images))
    pump(app, timeout=0.1)
    tool = app.tabs["Concepts"].open_dataset_tool(0)
    try:
        dialog = tool.open_label_dialog(CAPTION)
        pump(app, lambda: dialog.winfo_ismapped(), timeout=5, what="the auto-caption dialog")
        dialog.model_var.set("someone/tagger")
        dialog.download.button.invoke()
        size = human_size_of(files)
        pump(app, lambda: dialog.download.button.cget("text") == f"Download {size}", timeout=60,
             what=f"the listing ({dialog.status.cget('text')})")
        assert dialog.status.cget("text").startswith(f"someone/tagger: {len(files)} files, {size}, into ")
        assert hub.fetched == []  # listed, nothing fetched
        dialog.download.button.invoke()
        folder = tmp_path / "home" / "models" / "someone--tagger"
        pump(app, lambda: dialog.model_var.get() == str(folder), timeout=60,
             what=f"the download ({dialog.status.cget('text')})")
        assert sorted(hub.fetched) == sorted(f"someone/tagger/{name}" for name in files)
        assert dialog.status.cget("text") == f"Downloaded to {folder}. Press Start."
        assert dialog.download.button.cget("text") == "Download…" and dialog.bar.get() == 1.0
        dialog.destroy()
    finally:
        tool.destroy()
        hub.close()
    pump(app, timeout=0.2)
    assert app.callback_errors == []


def human_size_of(files: dict[str, bytes]) -> str:
    from modules.autolabel.hub_download import human_size

    return human_size(sum(map(len, files.values())))
