"""Concept cards and the concept window (issue 30 item 4), in a real window (Xvfb): a card shows
its concept's image count and a thumbnail of its first image; clicking it opens the concept's
window; a field changed there changes the config (and the card); the augmentation preview
mirrors every second draw when flip is on and draws anew on Re-roll; a folder of 1,000 images is
read without freezing the window; an edit concept (sibling folders or a manifest) shows its pairs,
each target with its controls, and what training skips."""

from __future__ import annotations

import time

import numpy as np
import pytest
from PIL import Image

from gui_driver import edit, fresh, pump

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


@pytest.fixture(scope="module")
def lopsided(tmp_path_factory):
    """Images that look different mirrored: red on the left, blue on the right."""
    folder = tmp_path_factory.mktemp("lopsided")
    for index in range(2):
        pixels = np.zeros((64, 96, 3), dtype=np.uint8)
        pixels[:, :40] = (220, 30, 30)
        pixels[:, 40:] = (30, 30, 220 - 40 * index)
        Image.fromarray(pixels).save(folder / f"image{index}.png")
        (folder / f"image{index}.txt").write_text("a lopsided picture")
    return folder


def _card_done(app, index: int = 0) -> bool:
    cards = app.tabs["Concepts"].cards
    return len(cards) > index and cards[index]["picture"] is not None


def test_a_card_shows_the_count_and_a_thumbnail_and_a_click_opens_its_window(app, shape_images):
    fresh(app)
    concepts = app.tabs["Concepts"]
    concepts.add(str(shape_images))
    app.tabview.set("Concepts")
    pump(app, lambda: _card_done(app), timeout=20, what="the card's thumbnail")
    card = concepts.cards[0]
    assert card["count"].cget("text") == "4 images"
    assert card["name"].cget("text") == shape_images.name  # no name set: the folder's
    assert max(card["picture"].cget("size")) <= 128
    assert str(card["thumb"]._label.cget("image")) in app.image_names()
    assert set(card["fields"]) == {"concepts[0].enabled", "concepts[0].repeats"}

    window = concepts.windows[0]
    assert not window.shown
    pump(app, lambda: card["thumb"].winfo_ismapped(), timeout=5, what="the card on screen")
    card["thumb"]._label.event_generate("<Button-1>")  # a click on the thumbnail
    pump(app, lambda: window.winfo_ismapped(), timeout=5, what="the concept's window")
    assert window.shown
    assert 0 <= window.winfo_rootx() - app.winfo_rootx() <= 100 and 0 <= window.winfo_rooty() - app.winfo_rooty() <= 100
    assert window.stats.cget("text").splitlines()[:2] == ["4 images", "Sizes: 64x64: 4"]
    assert "Without a caption: 0" in window.stats.cget("text")
    window.hide()
    pump(app, lambda: not window.winfo_ismapped(), timeout=5, what="the window hidden")
    assert app.callback_errors == []


def test_a_field_in_the_concept_window_changes_the_config_and_the_card(app, shape_images):
    fresh(app)
    concepts = app.tabs["Concepts"]
    concepts.add(str(shape_images))
    window = concepts.open(0)
    pump(app, lambda: window.winfo_ismapped(), timeout=5, what="the concept's window")
    assert app.field_for("concepts[0].repeats")[1].winfo_toplevel() is window  # the window's field is the field
    edit(app, "Concepts", "concepts[0].repeats", "3")
    edit(app, "Concepts", "concepts[0].name", "shapes")
    edit(app, "Concepts", "concepts[0].enabled", False)
    assert app.cfg.get("concepts")[0]["repeats"] == 3 and app.cfg.get("concepts")[0]["enabled"] is False
    card = concepts.cards[0]
    assert card["fields"]["concepts[0].repeats"].var.get() == "3"  # the card's own widgets follow
    assert card["fields"]["concepts[0].enabled"].var.get() is False
    pump(app, lambda: card["name"].cget("text") == "shapes", timeout=5, what="the card's name")
    assert window.title() == "Concept 1: shapes"
    card["fields"]["concepts[0].repeats"].var.set("5")  # and the other way round
    pump(app, timeout=0.05)
    assert app.field_for("concepts[0].repeats")[1].var.get() == "5" and app.cfg.get("concepts")[0]["repeats"] == 5
    window.hide()
    assert app.callback_errors == []


def _draws(window) -> list[np.ndarray]:
    return [np.asarray(image) for image in window.drawn]


def test_the_augmentation_preview_mirrors_with_flip_and_draws_anew_on_reroll(app, lopsided):
    fresh(app)
    edit(app, "Training", "data.resolution", "64")
    concepts = app.tabs["Concepts"]
    concepts.add(str(lopsided))
    pump(app, lambda: _card_done(app), timeout=20, what="the card")
    window = concepts.open(0)
    pump(app, lambda: len(window.drawn) == 4, timeout=60, what="the first draws")
    plain = _draws(window)
    assert plain[0].shape == (64, 96, 3) or plain[0].shape[:2] == (window.drawn[0].height, window.drawn[0].width)
    assert all(np.array_equal(plain[0], other) for other in plain[1:])  # no augmentation: four times the same
    assert "not mirrored" in window.augment_note.cget("text")

    edit(app, "Training", "data.flip", True)
    pump(app, lambda: not np.array_equal(_draws(window)[1], plain[1]), timeout=30, what="the draws with flip on")
    flipped = _draws(window)
    assert np.array_equal(flipped[0], plain[0]) and np.array_equal(flipped[2], plain[2])
    assert np.array_equal(flipped[1], plain[1][:, ::-1]) and np.array_equal(flipped[3], plain[3][:, ::-1])
    assert "mirrored half of the time" in window.augment_note.cget("text")

    edit(app, "Training", "data.cache_latents", False)
    edit(app, "Training", "data.color_jitter", "0.4")
    pump(app, lambda: not np.array_equal(_draws(window)[0], plain[0]), timeout=30, what="the draws with colour jitter")
    jittered = _draws(window)
    window.reroll_button.invoke()  # Re-roll: new draws of the same image
    pump(app, lambda: not np.array_equal(_draws(window)[0], jittered[0]), timeout=30, what="the re-rolled draws")
    assert all(draw.shape == plain[0].shape for draw in _draws(window))
    window.hide()
    assert app.callback_errors == []


def test_a_folder_of_a_thousand_images_is_read_without_freezing_the_window(app, tmp_path, monkeypatch):
    import ui.concept_stats as concept_stats

    header = concept_stats.image_size

    def slow_drive(path):  # a network drive or a spinning disk: 2 ms more per image read
        time.sleep(0.002)
        return header(path)

    monkeypatch.setattr(concept_stats, "image_size", slow_drive)
    folder = tmp_path / "thousand"
    folder.mkdir()
    for index in range(1000):
        Image.new("RGB", (24 + index % 5 * 8, 24), (index % 256, 80, 160)).save(folder / f"{index:04d}.png")
        if index % 3:
            (folder / f"{index:04d}.txt").write_text(f"picture {index}")
    fresh(app)
    app.tabview.set("Concepts")
    concepts = app.tabs["Concepts"]
    concepts.add(str(folder))
    pump(app, timeout=0.1)  # the new card and window laid out (the folder is read 300 ms after the edit)
    ticks = [time.monotonic()]

    def tick():
        ticks.append(time.monotonic())
        if not _card_done(app):
            app.after(20, tick)

    app.after(20, tick)
    started = time.monotonic()
    pump(app, lambda: _card_done(app), timeout=120, what="the card of 1,000 images")
    took = time.monotonic() - started
    longest = max(b - a for a, b in zip(ticks, ticks[1:]))
    assert concepts.cards[0]["count"].cget("text") == "1000 images\n334 without a caption"
    stats = concepts.windows[0].stats.cget("text")
    assert "Sizes: 24x24: 200, 32x24: 200, 40x24: 200, 48x24: 200, 56x24: 200" in stats
    assert "Without a caption: 334" in stats
    # the window answered all along (a read on the Tk thread would stall it for the whole read)
    assert took > 2.0  # the read was slow: on the Tk thread it would stall the window that long
    assert longest < 1.0, f"the window stalled {longest:.2f} s while reading 1,000 images (read took {took:.1f} s)"
    assert app.callback_errors == []


def _window_done(window) -> bool:
    slot = window.slot
    return bool(slot["items"]) and slot["picture"] is not None and len(slot["control_pictures"]) == len(
        slot["items"][slot["position"]].controls)


def test_an_edit_pair_concept_shows_its_pairs_their_controls_and_what_training_skips(app, tmp_path):
    """A folders-mode concept (target/, control/, control_2/): the card counts pairs, not the files of
    its folders (0 before: the concept folder itself holds no image; with subfolders the controls
    counted as images without captions); the window shows each target with its controls, named by
    folder, its augmentation preview with the controls beside the target, and the sample training
    skips for a missing control."""
    import shutil

    from modules.data.synthetic_images import write_edit_pairs

    write_edit_pairs(tmp_path / "pairs", count=3)
    shutil.copytree(tmp_path / "pairs" / "control", tmp_path / "pairs" / "control_2")
    (tmp_path / "pairs" / "control_2" / "001.png").unlink()  # its sample is skipped, as training skips it
    fresh(app)
    app.tabview.set("Concepts")
    concepts = app.tabs["Concepts"]
    concepts.add(str(tmp_path / "pairs"))
    edit(app, "Concepts", "concepts[0].include_subfolders", True)
    # as a plain concept, every file of its folders is an image (the controls without captions)
    pump(app, lambda: _card_done(app) and concepts.cards[0]["count"].cget("text") == "8 images\n5 without a caption",
         timeout=20, what="the card of the plain reading")
    edit(app, "Concepts", "concepts[0].controls.source", "folders")
    pump(app, lambda: "pairs" in concepts.cards[0]["count"].cget("text"), timeout=20, what="the card of the pairs")
    card = concepts.cards[0]
    assert card["count"].cget("text") == "2 pairs (a target and 2 control images each)\n1 skipped (see Statistics)"
    window = concepts.open(0)
    pump(app, lambda: _window_done(window), timeout=20, what="the first pair and its controls")
    stats = window.stats.cget("text")
    assert stats.splitlines()[:2] == ["2 pairs (a target and 2 control images each)", "Sizes: 64x64: 2"]
    assert f"Skipped: {tmp_path / 'pairs' / 'target' / '001.png'}: no control image 001.* in " \
           f"{tmp_path / 'pairs' / 'control_2'}" in stats
    assert "Without a caption: 0" in stats  # the targets' captions (the controls have none, and need none)
    names = [tile.master.winfo_children()[1].cget("text") for tile in window.slot["control_tiles"]]
    assert names == ["control 1: control/000.png", "control 2: control_2/000.png"]
    assert window.slot["caption"].cget("text").startswith("1/2  000.png")
    assert all(str(tile._label.cget("image")) in app.image_names() for tile in window.slot["control_tiles"])
    concepts.browse(0, 1)  # ▶: the next pair, with its own controls
    pump(app, lambda: _window_done(window) and window.slot["position"] == 1, timeout=20, what="the second pair")
    names = [tile.master.winfo_children()[1].cget("text") for tile in window.slot["control_tiles"]]
    assert names == ["control 1: control/002.png", "control 2: control_2/002.png"]
    # the augmentation preview draws the pair as training does: the target, then its two controls
    pump(app, lambda: len(window.drawn) == 4 and window.drawn[0].width == 3 * window.drawn[0].height, timeout=60,
         what="the preview of the second pair with its controls")
    tool = concepts.open_dataset_tool(0)  # "Captions…": the targets' captions, which training reads
    try:
        assert tool.folder == tmp_path / "pairs" / "target" and len(tool.images) == 3
    finally:
        tool.destroy()
    window.hide()
    assert app.callback_errors == []


def test_a_manifest_concept_counts_its_lines_pairs_and_names_a_bad_line(app, tmp_path):
    import json

    from modules.data.synthetic_images import write_edit_pairs

    write_edit_pairs(tmp_path / "pairs", count=2)
    manifest = tmp_path / "pairs" / "pairs.jsonl"
    lines = [json.dumps({"target": f"target/00{i}.png", "control": f"control/00{i}.png", "caption": "make it red"})
             for i in range(2)]
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    fresh(app)
    concepts = app.tabs["Concepts"]
    concepts.add(str(tmp_path / "pairs"))
    edit(app, "Concepts", "concepts[0].controls.source", "manifest")
    pump(app, lambda: _card_done(app) and "pair" in concepts.cards[0]["count"].cget("text"), timeout=20,
         what="the card of the manifest's pairs")
    assert concepts.cards[0]["count"].cget("text") == "2 pairs (a target and 1 control image each)"
    window = concepts.open(0)
    pump(app, lambda: _window_done(window), timeout=20, what="the first pair and its control")
    assert "Trained caption: make it red" in window.slot["caption"].cget("text")
    manifest.write_text(lines[0] + "\n{\"target\": \n", encoding="utf-8")
    concepts._captions_edited(0)  # read again (as after the dataset tool closes)
    pump(app, lambda: "line 2" in concepts.cards[0]["count"].cget("text"), timeout=20, what="the bad line named")
    assert concepts.cards[0]["count"].cget("text").startswith(f"controls.manifest: {manifest} line 2 is not JSON")
    assert window.slot["control_tiles"] == []  # no pair shown: no controls left over from the last one
    window.hide()
    assert app.callback_errors == []
