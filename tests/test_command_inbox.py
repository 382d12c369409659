"""The command inbox (modules/trainer/command_inbox.py, issue 30 item 5): a run started by one
process is sampled, backed up and stopped by another through files in its workspace; a bad file
is named in a warning, removed, and the run goes on; a file left before the run started is not
applied; a run the workspace lock refuses leaves the files to the run holding it; `launch.py
remote` forwards the local inbox to the box."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from functools import partial
from pathlib import Path

from conftest import ROOT, train_config
from forked_launch import launch_popen

from modules.trainer.command_inbox import CommandInbox, inbox_dir, post_command
from modules.trainer.commands import TrainCommands
from modules.trainer.event_protocol import apply_command


def _inbox(tmp_path: Path) -> tuple[CommandInbox, TrainCommands, list[str]]:
    commands, warnings = TrainCommands(), []
    inbox = CommandInbox(tmp_path, partial(apply_command, commands=commands), warnings.append)
    inbox.folder.mkdir(parents=True, exist_ok=True)
    return inbox, commands, warnings


def test_each_command_file_is_applied_once_in_order_and_removed(tmp_path):
    inbox, commands, warnings = _inbox(tmp_path)
    post_command(tmp_path, "backup")
    post_command(tmp_path, "sample", {"prompt": "a red circle", "seed": 7})
    post_command(tmp_path, "save")
    applied = inbox.collect()
    assert [name.rsplit("-", 1)[1] for name in applied] == ["backup.json", "sample.json", "save.json"]
    assert commands.take() == {"backup", "save"}
    assert [p["prompt"] for p in commands.take_prompts()] == ["a red circle"]
    assert not commands.stop_requested and warnings == []
    assert list(inbox.folder.iterdir()) == []
    assert inbox.collect() == []  # applied once
    post_command(tmp_path, "stop")
    inbox.collect()
    assert commands.stop_requested


def test_a_bad_command_file_is_named_in_a_warning_and_removed(tmp_path):
    inbox, commands, warnings = _inbox(tmp_path)
    folder = inbox_dir(tmp_path)
    (folder / "typo.json").write_text('{"command": "stopp"}')
    (folder / "broken.json").write_text('{"command": ')
    (folder / "huge-seed.json").write_text(json.dumps({"command": "sample", "prompt": {"prompt": "x", "seed": 2 ** 70}}))
    (folder / ".half-written.json.123.tmp").write_text('{"comm')  # a write in progress: not read
    assert inbox.collect() == []
    assert len(warnings) == 3, warnings
    by_file = {name: next(w for w in warnings if name in w) for name in ("typo.json", "broken.json", "huge-seed.json")}
    assert "expected {\"command\": one of stop, sample, backup, save}" in by_file["typo.json"]
    assert "not a JSON object" in by_file["broken.json"]
    assert "prompt.seed" in by_file["huge-seed.json"]  # the same parser and bounds as stdin's lines
    assert [p.name for p in folder.iterdir()] == [".half-written.json.123.tmp"]
    assert commands.take() == set() and not commands.stop_requested


def test_a_file_older_than_the_run_is_not_applied(tmp_path):
    inbox, commands, warnings = _inbox(tmp_path)
    stale = post_command(tmp_path, "stop")
    old = inbox.since - 3600
    os.utime(stale, (old, old))  # sent to a run that ended an hour before this one started
    assert inbox.collect() == []
    assert not commands.stop_requested
    assert not stale.exists()
    assert len(warnings) == 1 and "written before this run started" in warnings[0] and stale.name in warnings[0]


class _Run:
    """`launch.py train --protocol jsonl` in its own process; its stdin is closed at once, so only
    the inbox can reach it."""

    def __init__(self, tmp_path: Path, config):
        config_file = tmp_path / "run.json"
        config_file.write_text(config.model_dump_json())
        self.process = launch_popen(["train", "--config", str(config_file), "--protocol", "jsonl"], cwd=ROOT, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.events: list[dict] = []
        self.stderr: list[str] = []
        self._new: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_events, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.process.stderr), daemon=True).start()

    def _read_events(self) -> None:
        for line in self.process.stdout:
            if line.startswith("{"):
                event = json.loads(line)
                self.events.append(event)
                self._new.put(event)

    def wait_for(self, check, what: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self._new.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None and self._new.empty():
                    break
                continue
            if check(event):
                return event
        self.process.kill()
        raise AssertionError(f"no {what} in time; events {[e['event'] for e in self.events]}; "
                             f"stderr:\n{''.join(self.stderr)[-3000:]}")


def test_another_process_samples_backs_up_and_stops_a_run_through_its_inbox(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path, {
        "schedule": {"epochs": 500},  # far longer than the test: only the stop ends it
        "sampling": {"prompts": [{"prompt": "a red circle", "steps": 1, "width": 64, "height": 64}]}})
    workspace = Path(config.workspace_dir)
    run = _Run(tmp_path, config)
    try:
        run.wait_for(lambda e: e["event"] == "progress", "first step")
        inbox_dir(workspace).mkdir(exist_ok=True)  # (the run made it; a user's shell would find it there)
        (inbox_dir(workspace) / "bad.json").write_text("stop please")
        warning = run.wait_for(lambda e: e["event"] == "warning" and "bad.json" in e["message"], "the bad file's warning")
        assert "not a JSON object" in warning["message"]
        step = run.wait_for(lambda e: e["event"] == "progress", "a step after the bad file")["step"]
        assert run.process.poll() is None  # the run goes on

        post_command(workspace, "sample", {"prompt": "a blue square", "seed": 3, "steps": 1, "width": 64, "height": 64})
        sample = run.wait_for(lambda e: e["event"] == "sample", "the asked sample")
        assert "-now" in Path(sample["path"]).name and Path(sample["path"]).is_file()
        post_command(workspace, "backup")
        backup = run.wait_for(lambda e: e["event"] == "backup", "the asked backup")
        assert Path(backup["path"]).is_dir()
        post_command(workspace, "stop")
        run.wait_for(lambda e: e["event"] == "finished", "the end after the stop")
        assert run.process.wait(120) == 0, "".join(run.stderr)[-3000:]
    finally:
        if run.process.poll() is None:
            run.process.kill()
    names = [e["event"] for e in run.events]
    steps = [e["step"] for e in run.events if e["event"] == "progress"]
    assert steps[-1] > step and steps[-1] < config.schedule.epochs  # stopped long before its end
    assert names.count("backup") >= 2 and "saved" in names  # the asked one, and the stop's own
    assert list(inbox_dir(workspace).iterdir()) == []


def test_launch_remote_forwards_its_local_inbox_to_the_run_on_the_box(tmp_path):
    """A window reopened after the one that started `launch.py remote` writes into the local
    workspace's inbox; the relay sends each command on to the box (a fake RemoteRun here)."""
    import signal
    from types import SimpleNamespace

    from modules.remote import cli

    sent = []

    class BoxRun:
        local_workspace = tmp_path
        returncode = 0
        target = SimpleNamespace(label="box")

        def send_command(self, name, prompt=None):
            sent.append((name, prompt))
            return True

        def events(self):
            yield {"event": "started", "total_steps": 9}
            post_command(tmp_path, "sample", {"prompt": "a red circle"})
            post_command(tmp_path, "stop")
            deadline = time.monotonic() + 20
            while len(sent) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            yield {"event": "finished"}

    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert cli.relay(BoxRun(), cli._Output("text"), retries=0) == 0
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    assert [name for name, _ in sent] == ["sample", "stop"]
    assert sent[0][1]["prompt"] == "a red circle"
    assert list(inbox_dir(tmp_path).iterdir()) == []


def test_a_run_refused_by_the_workspace_lock_leaves_the_inbox_to_the_run_holding_it(tmp_path, tiny_model,
                                                                                     shape_images):
    import pytest

    from modules.saving.workspace_lock import LOCK_NAME, WorkspaceBusyError
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_model, shape_images, tmp_path)
    workspace = Path(config.workspace_dir)
    workspace.mkdir(parents=True)
    (workspace / LOCK_NAME).write_text(json.dumps({"pid": 4242, "host": "the-box-that-trains"}))
    sent = post_command(workspace, "stop")  # for the run holding the workspace
    commands = TrainCommands()
    trainer = GenericTrainer(config, commands=commands)
    with pytest.raises(WorkspaceBusyError):
        trainer.start()
    trainer.release()
    assert sent.exists() and not commands.stop_requested
