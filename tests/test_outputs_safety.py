"""A good file is never lost to a run: no save without a training step, an existing output.path
of another run refused or versioned (output.if_exists), a workspace per run (default output path,
lock file), file modes as the umask says, unfinished backup folders cleaned up.
Cases a user meets run through the CLI as child processes; each checks the earlier files are intact."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, train_config
from forked_launch import launch_popen

from modules.cli.train_command import run_training
from modules.util.atomic import write_text
from modules.saving.workspace_lock import LOCK_NAME, WorkspaceBusyError, WorkspaceLock
from modules.trainer.callbacks import TrainCallbacks


def _state(path: Path) -> tuple[str, int]:
    """(content hash, mtime) of a file: both must stay as they were."""
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def _good_output(path: Path) -> tuple[str, int]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"a good adapter of an earlier run")
    return _state(path)


def _config_file(tmp_path: Path, tiny_model, shape_images, *overlays: dict) -> tuple[Path, object]:
    config = train_config(tiny_model, shape_images, tmp_path, *overlays)
    file = tmp_path / "config.json"
    file.write_text(config.model_dump_json())
    return file, config


def _child(config_file: Path, *extra: str) -> subprocess.Popen:
    return launch_popen(["train", "--config", str(config_file), "--protocol", "jsonl", *extra], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


class Recorder(TrainCallbacks):
    def __init__(self):
        self.warnings, self.saved, self.statuses = [], [], []

    def on_warning(self, message):
        self.warnings.append(message)

    def on_save(self, path, consumers=None):
        self.saved.append(path)

    def on_status(self, text):
        self.statuses.append(text)


@pytest.mark.parametrize("how", ["stop command", "ctrl-c while loading"])
def test_a_stop_before_the_first_step_saves_nothing_over_a_good_file(tmp_path, tiny_model, shape_images, how):
    # overwrite: only the no-step rule stands between the untrained adapter and the good file
    config_file, config = _config_file(tmp_path, tiny_model, shape_images, {"output": {"if_exists": "overwrite"}})
    output = Path(config.output.path)
    before = _good_output(output)
    process = _child(config_file)
    if how == "stop command":  # after a malformed one, which must not deafen the command reader
        process.stdin.write('{"command": ["stop"]}\n{"command": "stop"}\n')
        process.stdin.flush()
    else:
        for line in process.stderr:  # the console log: SIGINT once the model load has begun
            if "loading model" in line:
                process.send_signal(signal.SIGINT)
                break
    stdout, stderr = process.communicate(timeout=180)
    assert process.returncode == 0, stderr
    events = _events(stdout)
    names = [e["event"] for e in events]
    assert "saved" not in names and "backup" not in names and "progress" not in names, names
    assert any("no training step ran, so nothing was saved" in e.get("message", "") for e in events), events
    if how == "stop command":
        assert any(e["event"] == "warning" and '{"command": ["stop"]}' in e["message"] for e in events), events
    assert _state(output) == before
    assert not (Path(config.workspace_dir) / "backup").exists()
    assert not (Path(config.workspace_dir) / "cache").exists()  # stopped before caching the data
    assert not (Path(config.workspace_dir) / LOCK_NAME).exists()  # released at the end


def test_a_stop_after_loading_before_step_1_writes_no_backup_and_no_output(tmp_path, tiny_model, shape_images):
    from modules.trainer.commands import TrainCommands
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_model, shape_images, tmp_path, {"output": {"if_exists": "overwrite"}})
    before = _good_output(Path(config.output.path))
    commands, callbacks = TrainCommands(), Recorder()
    trainer = GenericTrainer(config, callbacks, commands)
    trainer.start()
    commands.stop()  # the GUI's stop, between the data caching and the first step
    trainer.train()
    assert trainer.end() is None
    assert trainer.step == 0 and callbacks.saved == []
    assert not (Path(config.workspace_dir) / "backup").exists()
    assert _state(Path(config.output.path)) == before


def test_an_existing_output_of_another_run_is_refused_before_training(tmp_path, tiny_model, shape_images):
    config_file, config = _config_file(tmp_path, tiny_model, shape_images, {"output": {"if_exists": "refuse"}})
    output = Path(config.output.path)
    before = _good_output(output)
    earlier_config = Path(config.workspace_dir) / "config.json"
    write_text(earlier_config, "{}")
    config_before = _state(earlier_config)
    started = time.monotonic()
    process = _child(config_file)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 1
    (error,) = [e["message"] for e in _events(stdout) if e["event"] == "error"]
    assert error.startswith("output.path: ") and str(output) in error and "output.if_exists" in error
    assert "Traceback" not in stderr
    assert _state(output) == before and _state(earlier_config) == config_before
    assert sorted(p.name for p in output.parent.iterdir()) == [output.name]
    assert time.monotonic() - started < 60  # refused before the model load and the data caching


def test_version_saves_beside_a_foreign_file_and_a_resume_replaces_only_its_own(tmp_path, tiny_model, shape_images):
    overlay = {"schedule": {"epochs": 1, "batch_size": 4, "backup_every": "1 epochs"},
               "output": {"if_exists": "version"}}
    config = train_config(tiny_model, shape_images, tmp_path, overlay)
    output = Path(config.output.path)
    before = _good_output(output)
    unfinished = Path(config.workspace_dir) / "backup" / ".tmp-20240101-000000-step0000001"
    unfinished.mkdir(parents=True)  # left by a run killed while writing a backup
    (unfinished / "adapter.safetensors").write_bytes(b"half")

    first = Recorder()
    saved = run_training(config, first)
    assert saved == output.with_name("lora-2.safetensors") and saved.is_file()
    assert any("lora-2.safetensors" in w and "output.if_exists: version" in w for w in first.warnings)
    assert _state(output) == before
    assert not unfinished.exists()
    assert any("unfinished backup folder" in s for s in first.statuses)

    # a resume of that run (one more epoch) replaces the file it saved, not the foreign one
    first_saved = _state(saved)
    resumed = Recorder()
    again = run_training(train_config(tiny_model, shape_images, tmp_path, overlay,
                                      {"schedule": {"epochs": 2}, "backup": {"resume": True}}), resumed)
    assert again == saved and _state(saved) != first_saved
    assert _state(output) == before
    assert sorted(p.name for p in output.parent.iterdir()) == ["lora-2.safetensors", "lora.safetensors"]


def test_the_default_output_path_is_the_workspace_s_own(tmp_path):
    from modules.config.loading import build_config

    first = build_config([{"workspace_dir": str(tmp_path / "cat")}])
    second = build_config([{"workspace_dir": str(tmp_path / "dog")}])
    assert first.output.path == "" and first.output_path == tmp_path / "cat" / "output" / "cat.safetensors"
    assert second.output_path.parent.parent == tmp_path / "dog"


def test_the_default_workspace_names_its_output_by_family_and_what_is_trained(tmp_path):
    # "workspace.safetensors" said nothing once copied out (issue 30, defect 10)
    from modules.config.loading import build_config

    folder = str(tmp_path / "workspace")
    lora = build_config([{"workspace_dir": folder, "model": {"family": "sdxl"}}])
    loha = build_config([{"workspace_dir": folder, "adapter": {"type": "loha"}}])
    tuned = build_config([{"workspace_dir": folder, "model": {"family": "flux"}, "method": {"type": "fine_tune"}}])
    assert lora.output_path == tmp_path / "workspace" / "output" / "sdxl-lora.safetensors"
    assert loha.output_path.name == "sd15-loha.safetensors"
    assert tuned.output_path.name == "flux-fine_tune.safetensors"


def test_a_second_run_on_a_workspace_in_use_is_refused_naming_the_lock_and_pid(tmp_path, tiny_model, shape_images):
    config_file, config = _config_file(tmp_path, tiny_model, shape_images)
    workspace = Path(config.workspace_dir)
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # the first run, alive
    try:
        lock = workspace / LOCK_NAME
        write_text(lock, json.dumps({"pid": owner.pid, "host": os.uname().nodename, "started": "earlier"}))
        write_text(workspace / "config.json", '{"the first run": true}')
        files_before = {p: _state(p) for p in workspace.rglob("*") if p.is_file()}
        process = _child(config_file)
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 1
        (error,) = [e["message"] for e in _events(stdout) if e["event"] == "error"]
        assert error.startswith("workspace_dir: ") and f"PID {owner.pid}" in error and str(lock) in error
        assert "Traceback" not in stderr
        assert {p: _state(p) for p in workspace.rglob("*") if p.is_file()} == files_before
    finally:
        owner.kill()
        owner.wait()


def test_a_stale_lock_of_a_dead_run_is_reclaimed_with_a_warning(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its PID now names no process
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
    warnings = []
    lock = WorkspaceLock(tmp_path, warnings.append)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert len(warnings) == 1 and f"PID {dead.pid}" in warnings[0] and "reclaimed" in warnings[0]
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_from_another_host_is_refused_not_reclaimed(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "some-other-box"}))
    with pytest.raises(WorkspaceBusyError, match="some-other-box"):
        WorkspaceLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "some-other-box"


def test_written_files_have_the_umask_s_permissions_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        write_text(tmp_path / "a.json", "{}")
        assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
        os.umask(0o002)
        write_text(tmp_path / "b.json", "{}")
        assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o664
    finally:
        os.umask(old)


def test_safetensors_writes_have_the_umask_s_permissions_too(tmp_path):
    # safetensors' save_file replaces the temp file it is given with a 0o600 file of its own
    from safetensors.torch import save_file

    from modules.util.atomic import write_with

    old = os.umask(0o022)
    try:
        target = tmp_path / "lora.safetensors"
        write_with(target, lambda temp: save_file({"w": torch.zeros(2)}, str(temp)))
        assert target.stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)


def test_a_lock_whose_pid_now_names_another_program_is_reclaimed(tmp_path):
    # the PID exists (this test's own parent), but it was created long before the run that wrote the lock
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": os.uname().nodename,
                                                  "created": time.time() - 5}))
    warnings = []
    lock = WorkspaceLock(tmp_path, warnings.append)
    lock.acquire()
    assert len(warnings) == 1 and "reclaimed" in warnings[0]
    lock.release()


def test_a_workspace_gone_read_only_reports_the_write_that_stopped_the_run_not_the_lock(
        tmp_path, tiny_model, one_image, monkeypatch):
    import errno

    from modules.errors import NotWritableError
    from modules.trainer import outputs

    def backup_refused(workspace, *args, **kwargs):
        raise NotWritableError(f"cannot write {workspace}/backups/step-1: read-only file system")

    original_unlink = Path.unlink

    def unlink(self, *args, **kwargs):
        if self.name == LOCK_NAME:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return original_unlink(self, *args, **kwargs)

    monkeypatch.setattr(outputs, "write_backup", backup_refused)  # the trainer writes its backups there
    monkeypatch.setattr(Path, "unlink", unlink)
    config = train_config(tiny_model, one_image, tmp_path, {"schedule": {"backup_every": 1, "max_steps": 1}})
    recorder = Recorder()
    with pytest.raises(NotWritableError, match="backups/step-1"):
        run_training(config, recorder)
    assert any("could not remove the lock file" in w for w in recorder.warnings)


def test_the_cache_command_takes_the_workspace_lock_a_training_run_takes(tmp_path, tiny_model, one_image):
    from modules.cli.cache_command import build_caches

    config = train_config(tiny_model, one_image, tmp_path)
    lock = Path(config.workspace_dir) / LOCK_NAME
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a train, alive
    try:
        write_text(lock, json.dumps({"pid": owner.pid, "host": os.uname().nodename, "started": "earlier"}))
        with pytest.raises(WorkspaceBusyError, match=f"PID {owner.pid}"):
            build_caches(config)
        assert not (Path(config.workspace_dir) / "cache").exists()  # refused before it encoded anything
    finally:
        owner.kill()
        owner.wait()
    lock.unlink()
    build_caches(config)  # free: it takes the lock, and gives it back when done
    assert not lock.exists()


def test_the_cache_command_refuses_an_empty_workspace_and_a_device_output_is_refused_at_resolve(tmp_path):
    from modules.cli.cache_command import build_caches
    from modules.config.loading import build_config
    from modules.errors import UserError
    from modules.saving.output_target import resolve_output

    config = build_config([{"workspace_dir": "", "concepts": [{"path": str(tmp_path)}]}])
    with pytest.raises(UserError, match="^workspace_dir: empty"):
        build_caches(config)
    # the remote run resolves its output here too: /dev/null is not versioned into /dev/null-2
    with pytest.raises(UserError, match="^output.path: /dev/null is not a regular file"):
        resolve_output(Path("/dev/null"), "version", tmp_path, False, lambda text: None)
