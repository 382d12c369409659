"""A remote run started and watched from the window: the GUI's Remote section points at a real
sshd on 127.0.0.1 (tests/test_remote.py's fixture; the "box" is this machine), Start runs
`launch.py remote` as the child, and progress, samples and the adapter come back as for a local run.
The window's relay is then killed mid-run (a window that crashed, a laptop gone to sleep): the run
goes on on the box, and the next window finds it and reattaches with `launch.py remote --attach`."""

from __future__ import annotations

import sys
from pathlib import Path

from gui_driver import pump, run_to_end, wait_for_event
from test_remote import sshd  # noqa: F401  (the fixture)


def test_remote_run_from_the_window(display, home, sshd, tiny_model, shape_images, tmp_path):  # noqa: F811
    from modules.config.loading import build_config
    from ui.app import App

    target = sshd(tmp_path / "box")
    app = App(machine_info={"families": {}, "devices": {"cpu": {}}}, restore=False)
    try:
        config = build_config([{
            "model": {"base": str(tiny_model)}, "concepts": [{"path": str(shape_images)}],
            "data": {"resolution": 64}, "adapter": {"rank": 4, "alpha": 2}, "optimizer": {"lr": 5e-3},
            "schedule": {"epochs": 2, "batch_size": 2, "sample_every": "4 steps"},
            "sampling": {"prompts": [{"prompt": "a red circle", "steps": 2, "width": 64, "height": 64}]},
            "workspace_dir": str(tmp_path / "ws"), "tensorboard": False, "train_device": "cpu",
            "output": {"path": str(tmp_path / "out" / "remote.safetensors"), "dtype": "float32"}}])
        app.cfg.load(config.model_dump(mode="json"))
        remote = app.tabs["General"].remote_vars
        for key, value in {"host": target.host, "port": str(target.port), "remote_dir": target.remote_dir,
                           "identity_file": target.identity_file, "known_hosts": target.known_hosts,
                           "python": sys.executable}.items():
            remote[key].set(value)
        pump(app, timeout=0.05)
        assert app.remote_problem() is None
        assert app.start(), app.refused
        assert app.client.argv[2] == "remote"
        wait_for_event(app, "progress", timeout=180)
        first_steps = list(app.tabs["Run"].steps)
        app.client.process.kill()  # the relay dies without a word; the run on the box goes on
        app.client.wait(30)
    finally:
        app.destroy()

    from ui.remote_run import detached_remote_run

    app = App(machine_info={"families": {}, "devices": {"cpu": {}}})  # a window opened later (it looks for runs)
    try:
        pump(app, lambda: app.client is not None, timeout=10, what="the reattach")
        assert app.client.argv[2] == "remote" and "--attach" in app.client.argv
        assert "reattaching to the remote run of" in app.tabs["Run"].log_text()
        assert run_to_end(app, timeout=240) == 0, app.tabs["Run"].log_text()[-3000:]
        names = [e["event"] for e in app.run_events]
        assert names[-1] == "finished"
        steps = app.tabs["Run"].steps  # the steps the dead relay showed, then the rest from the box
        assert steps[:len(first_steps)] == first_steps and sorted(set(steps)) == [1, 2, 3, 4], steps
        samples = [e["path"] for e in app.run_events if e["event"] == "sample"]
        assert samples and all(Path(p).is_file() for p in samples)  # brought back, local paths
        assert (tmp_path / "out" / "remote.safetensors").is_file()
        assert app.status_label.cget("text") == "Finished." and app.dialogs == []
        from modules.config.presets import user_dir

        assert detached_remote_run(user_dir() / "runs") is None  # the next window starts fresh
    finally:
        app.destroy()
