"""Reattach with full control (issue 30 item 5), in real windows (Xvfb): a GUI process starts a run
and closes, leaving it training; a new window finds it, follows it, and its Sample now, Backup now,
Save now and Stop buttons reach it through the run's command inbox (modules/trainer/command_inbox.py).

The run is a small child that speaks the run protocol and reads its inbox with the trainer's own
CommandInbox and TrainCommands, without training (what is checked is the window and the channel;
tests/test_command_inbox.py drives a real training run the same way)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psutil
from conftest import ROOT

from gui_driver import pump

MACHINE = {"families": {}, "devices": {"cpu": {}}}

# argv[1]: the config file the window wrote. Steps every 0.2 s until stopped (at most 60 s);
# SIGTERM is left at its default (it would end the run without a backup), so only the inbox's
# stop gives the "Stopped ...; a backup was written" ending
RUN = textwrap.dedent("""
    import json, sys, time
    from functools import partial
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from PIL import Image
    from modules.trainer.command_inbox import CommandInbox
    from modules.trainer.commands import TrainCommands
    from modules.trainer.event_protocol import apply_command
    def emit(**event):
        print(json.dumps(event), flush=True)
    workspace = Path(json.loads(Path(sys.argv[1]).read_text())["workspace_dir"])
    commands = TrainCommands()
    CommandInbox(workspace, partial(apply_command, commands=commands), lambda m: emit(event="warning", message=m)).open()
    emit(event="started", total_steps=1000)
    step, deadline = 0, time.monotonic() + 60
    while not commands.stop_requested and time.monotonic() < deadline:
        time.sleep(0.2)
        step += 1
        emit(event="progress", step=step, total_steps=1000, epoch=0, epochs=1, loss=0.5, lr=1e-4, it_per_s=5.0, eta_s=9.0)
        for action in sorted(commands.take()):
            path = workspace / f"{{action}}-{{step}}"
            if action == "sample":
                path = path.with_suffix(".png")
                Image.new("RGB", (8, 8), "red").save(path)
            emit(event={{"sample": "sample", "backup": "backup", "save": "saved"}}[action], path=str(path))
    emit(event="backup", path=str(workspace / "backup-stop"))
    emit(event="saved", path=str(workspace / "out.safetensors"))
    emit(event="finished")
""").format(root=str(ROOT))

# the first window, in its own process: start the run above, wait for its first step, close and
# leave it running
FIRST_WINDOW = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from gui_driver import pump
    from ui.app import App
    window = App(machine_info={machine!r}, restore=False)
    window.cfg.set("workspace_dir", sys.argv[1])
    window.cfg.start_problems = lambda: []  # the child trains nothing: no model or concepts needed
    window.run_argv = lambda config_file: [sys.executable, "-c", sys.argv[2], str(config_file)]
    assert window.start()
    pump(window, lambda: any(e["event"] == "progress" for e in window.run_events), timeout=30, what="step 1")
    window.ask_close = lambda: "leave"
    window.on_close()
    print(window.client.pid, flush=True)
""").format(root=str(ROOT), machine=MACHINE)


def test_a_window_reattached_to_a_run_of_an_earlier_gui_process_samples_backs_up_saves_and_stops_it(
        display, home, tmp_path):
    from modules.config.presets import user_dir
    from ui.app import App
    from ui.attached_run import find_live_run

    workspace = tmp_path / "ws"
    first = subprocess.run([sys.executable, "-c", FIRST_WINDOW, str(workspace), RUN], cwd=ROOT / "tests",
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    pid = int(first.stdout.split()[-1])
    assert psutil.pid_exists(pid) and find_live_run(user_dir() / "runs")[1] == pid

    window = App(machine_info=MACHINE)
    try:
        pump(window, lambda: window.running and window.tabs["Run"].steps, timeout=30, what="the reattached run's steps")
        assert "reach it through its command inbox" in window.tabs["Run"].log_text()
        events = lambda name: [e for e in window.run_events if e.get("event") == name]  # noqa: E731
        for command, event in (("backup", "backup"), ("save", "saved"), ("sample", "sample")):
            button = window.command_buttons[command]
            assert button.cget("state") == "normal"
            before = len(events(event))
            button.invoke()
            pump(window, lambda: len(events(event)) > before, timeout=20, what=f"the {event} asked with {command} now")
        assert window.tabs["Run"].log_text().count("[asked for:") == 3
        assert not events("warning"), events("warning")
        window.start_button.invoke()  # Stop
        assert window.status_label.cget("text").startswith("Stopping")
        pump(window, lambda: not window.running and window.start_button.cget("text") == "Start training",
             timeout=30, what="the reattached run to stop")
        assert window.status_label.cget("text").startswith("Stopped at step "), window.status_label.cget("text")
        assert window.status_label.cget("text").endswith("; a backup was written.")
        assert find_live_run(user_dir() / "runs") is None
        assert list((workspace / "commands").iterdir()) == []
    finally:
        try:
            window.destroy()
        except Exception:
            pass
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass

