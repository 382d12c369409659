"""A video sample in the Run tab's gallery (issue 28 item 3): its poster with Play, which plays the
video in its cell at thumbnail size (ui/video_playback.py: PyAV for .mp4, Pillow for .webp), and
Open, which hands it to the system's player; a video that cannot be read is said, the poster stays."""

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


@pytest.mark.parametrize("size, suffix", [((32, 16), ".mp4"), ((15, 9), ".webp")])  # odd sizes: no H.264
def test_a_video_sample_plays_in_its_gallery_cell_and_opens_in_the_system_player(app, tmp_path, monkeypatch, size,
                                                                                   suffix):
    from PIL import Image

    from modules.sampling.video_writer import write_sample_video

    frames = [Image.new("RGB", size, colour) for colour in ("red", "green", "blue")]
    video, poster = write_sample_video(tmp_path / "step0000004-0", frames, fps=50.0)
    assert video.suffix == suffix
    still = tmp_path / "step0000004-1.png"
    Image.new("RGB", (16, 16), "white").save(still)
    run_tab = app.tabs["Run"]
    run_tab.clear()
    run_tab.add_sample(str(still))
    run_tab.add_sample(str(poster))

    def buttons(widget):
        for child in widget.winfo_children():
            if child.winfo_class() == "CTkButton" or hasattr(child, "invoke"):
                yield child
            yield from buttons(child)

    texts = [button.cget("text") for button in buttons(run_tab.gallery)]
    assert texts.count("\u25b6 Play") == 1 and texts.count("Open") == 1  # the still sample has none
    play = next(b for b in buttons(run_tab.gallery) if b.cget("text") == "\u25b6 Play")
    play.invoke()
    player = run_tab.players[str(poster)]
    pump(app, timeout=0.3)
    assert player.playing and player.shown >= 3 and play.cget("text") == "\u25a0 Stop"
    shown = player.label.cget("image")
    assert len(player.frames) == 3
    play.invoke()
    assert not player.playing and play.cget("text") == "\u25b6 Play" and player.label.cget("image") != shown
    opened = []
    monkeypatch.setattr("ui.video_playback.subprocess.Popen", lambda argv, **_: opened.append(argv))
    next(b for b in buttons(run_tab.gallery) if b.cget("text") == "Open").invoke()
    assert opened and opened[0][-1] == str(video)
    video.write_bytes(b"not a video")  # half-written or foreign: said, the poster stays
    run_tab._show_samples()
    next(b for b in buttons(run_tab.gallery) if b.cget("text") == "\u25b6 Play").invoke()
    assert app.status_label.cget("text").startswith(f"Cannot play {video.name}")
    run_tab.clear()
