"""A stop is honoured within seconds in every phase of a headless run (issue 26): between cached
batches, between sampler steps, and a second signal even while the main thread is stuck in one long
call. Each case is a `launch.py train` child on the tiny SD1.5 model, signalled as a user would."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, train_config
from forked_launch import python_popen

from modules.saving.backup import list_backups, read_backup
from modules.saving.workspace_lock import LOCK_NAME

# run launch.py with a test hook put in first (argv[1]: which one; the rest: launch.py's arguments)
_CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, os.getcwd())
    hook = sys.argv.pop(1)
    if hook == "slow-caching":  # every batch of images takes a second to encode
        import modules.data.cache_build as cache_build
        encode = cache_build._encode_chunk
        def slow(*args, **kwargs):
            print("[test: encoding a batch]", file=sys.stderr, flush=True)
            time.sleep(1.0)
            return encode(*args, **kwargs)
        cache_build._encode_chunk = slow
    elif hook == "stuck-step":  # step 2 never comes back to the interpreter (like one long torch call)
        from modules.trainer.generic_trainer import GenericTrainer
        forward = GenericTrainer._forward
        def stuck(self, *args, **kwargs):
            if self.step == 1:
                print("[test: in a long step]", file=sys.stderr, flush=True)
                # libc's system() retries its wait when a signal interrupts it, so no Python signal
                # handler runs until it returns
                os.system("sleep 20 </dev/null >/dev/null 2>&1")
            return forward(self, *args, **kwargs)
        GenericTrainer._forward = stuck
    import launch
    sys.exit(launch.main(sys.argv[1:]))
""")


class _Child:
    """A train run whose stdout events and stderr lines are read on threads, so a test can wait
    for a line with a deadline and see when it came. (What is timed is the run's answer to a
    signal, not its exit: the interpreter's own teardown after torch and diffusers takes seconds
    more on a busy machine.)"""

    def __init__(self, tmp_path: Path, config, hook: str = "none", *extra: str, command: str = "train"):
        config_file = tmp_path / "run.json"
        config_file.write_text(config.model_dump_json())
        protocol = ["--protocol", "jsonl"] if command == "train" else []
        self.process = python_popen(
            ["-c", _CHILD, hook, command, "--config", str(config_file), *protocol, *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.events: list[dict] = []
        self.stderr: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(self.process.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.process.stderr, False), daemon=True).start()

    def _read(self, stream, is_events: bool) -> None:
        for line in stream:  # (stdout: events, or the cache command's summary)
            if is_events and line.startswith("{"):
                self.events.append(json.loads(line))
            elif not is_events:
                self.stderr.append(line)
            self._lines.put((time.monotonic(), line))

    def wait_for(self, text: str, timeout: float = 120) -> float:
        """When a line holding `text` came (time.monotonic)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                when, line = self._lines.get(timeout=0.5)
                if text in line:
                    return when
            except queue.Empty:
                if self.process.poll() is not None:
                    break
        self.process.kill()
        raise AssertionError(f"no {text!r} in time; stderr:\n{''.join(self.stderr)[-3000:]}")

    def signal_and_time(self, answer: str, limit: float) -> float:
        """Send SIGTERM; the seconds until a line holding `answer` came (the process waited for)."""
        start = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        took = self.wait_for(answer, timeout=limit) - start
        self.process.wait(timeout=120)
        return took

    def names(self) -> list[str]:
        time.sleep(0.2)  # the reader threads drain what the process wrote last
        return [e["event"] for e in self.events]


def _temp_files(*folders: Path) -> list[Path]:
    return [p for folder in folders if folder.exists() for p in folder.rglob("*")
            if p.name.endswith(".tmp") or p.name.startswith(".tmp-")]


def test_sigterm_while_caching_stops_between_batches(tmp_path, tiny_model, shape_images):
    # 4 images at 6 resolutions (one bucket each): 6 batches of a second each (slow-caching)
    config = train_config(tiny_model, shape_images, tmp_path, {"data": {"resolution": [64 * i for i in range(1, 7)]}})
    child = _Child(tmp_path, config, "slow-caching")
    child.wait_for("[test: encoding a batch]")
    took = child.signal_and_time("[stopped before the first step", limit=60)
    assert took < 5, f"caching went on {took:.1f} s after SIGTERM"
    assert child.process.returncode == 0, "".join(child.stderr)[-3000:]
    names = child.names()
    assert "progress" not in names and "saved" not in names and "backup" not in names, names
    assert any("stopped before the first step" in line for line in child.stderr)
    cached = list((Path(config.workspace_dir) / "cache" / "latents").rglob("*.safetensors"))
    assert 1 <= len(cached) < 6 * 4  # what was encoded stays for the next run; the rest was not
    assert "Traceback" not in "".join(child.stderr)
    assert not (Path(config.workspace_dir) / LOCK_NAME).exists()


def test_sigterm_stops_the_cache_command_between_batches_too(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path, {"data": {"resolution": [64 * i for i in range(1, 7)]}})
    child = _Child(tmp_path, config, "slow-caching", command="cache")
    child.wait_for("[test: encoding a batch]")
    took = child.signal_and_time("stopped; the entries written so far stay", limit=60)
    assert took < 5, f"caching went on {took:.1f} s after SIGTERM"
    assert child.process.returncode == 0, "".join(child.stderr)[-3000:]
    assert any("SIGTERM: stopping after the batch being encoded" in line for line in child.stderr)
    cached = list((Path(config.workspace_dir) / "cache" / "latents").rglob("*.safetensors"))
    assert 1 <= len(cached) < 6 * 4
    assert not (Path(config.workspace_dir) / LOCK_NAME).exists()


def test_sigterm_during_a_long_sample_stops_within_seconds_with_a_backup(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path, {
        "schedule": {"epochs": 100, "sample_every": "1 steps"},
        "sampling": {"prompts": [{"prompt": "a red circle", "steps": 500, "width": 64, "height": 64}]}})
    child = _Child(tmp_path, config)
    child.wait_for("[sampling]")
    time.sleep(0.5)  # some sampler steps in
    took = child.signal_and_time('"event": "backup"', limit=120)
    assert took < 8, f"the sample went on {took:.1f} s after SIGTERM"
    assert child.process.returncode == 0, "".join(child.stderr)[-3000:]
    names = child.names()
    assert names.count("backup") == 1 and "sample" not in names, names  # the unfinished sample is dropped
    (backup,) = list_backups(Path(config.workspace_dir))
    assert read_backup(backup)[1]["step"] == 1
    assert not list((Path(config.workspace_dir) / "samples").glob("*.png"))
    assert Path(config.output.path).is_file()


def test_a_second_sigterm_quits_within_seconds_even_inside_a_long_step(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path, {"schedule": {"epochs": 100, "batch_size": 1,
                                                                            "backup_every": "1 steps"}})
    child = _Child(tmp_path, config, "stuck-step")
    child.wait_for("[test: in a long step]")
    child.process.send_signal(signal.SIGTERM)
    # said at once, though the main thread cannot run a signal handler now
    child.wait_for("SIGTERM: stopping at the next step", timeout=5)
    start = time.monotonic()
    child.process.send_signal(signal.SIGTERM)
    child.process.wait(timeout=60)
    took = time.monotonic() - start  # (os._exit: no teardown to wait for)
    assert took < 6, f"still running {took:.1f} s after the second SIGTERM"
    assert child.process.returncode == 130
    assert child.events[-1]["event"] == "error", child.events[-3:]
    assert child.events[-1]["message"].startswith("interrupted at step 1:")
    workspace, output = Path(config.workspace_dir), Path(config.output.path)
    assert not output.exists() and _temp_files(workspace, output.parent) == []
    (backup,) = list_backups(workspace)  # step 1's, whole
    assert read_backup(backup)[1]["step"] == 1
    assert not (workspace / LOCK_NAME).exists()  # released on the way out


@pytest.fixture
def finished_workspace(tmp_path, tiny_model, shape_images):
    from modules.cli.train_command import run_training
    from modules.trainer.callbacks import TrainCallbacks

    config = train_config(tiny_model, shape_images, tmp_path, {"schedule": {"max_steps": 1}})
    run_training(config, TrainCallbacks())  # finishes; backup_every 0 leaves no backup
    assert not list_backups(Path(config.workspace_dir))
    return config


def test_resume_of_a_finished_workspace_without_a_backup_is_refused_not_retrained(finished_workspace):
    from modules.cli.train_command import run_training
    from modules.errors import UserError
    from modules.trainer.callbacks import TrainCallbacks

    config = finished_workspace.model_copy(update={"backup": finished_workspace.backup.model_copy(
        update={"resume": True})})
    output = Path(config.output.path)
    before = output.stat().st_mtime_ns

    class Steps(TrainCallbacks):
        steps: list = []

        def on_progress(self, progress):
            self.steps.append(progress.step)

    with pytest.raises(UserError) as refused:
        run_training(config, Steps())
    assert str(refused.value).startswith("backup.resume: the run in ")
    assert "leave out --resume" in str(refused.value)
    assert Steps.steps == [] and output.stat().st_mtime_ns == before
    assert not (Path(config.workspace_dir) / LOCK_NAME).exists()
