"""What the machine or a damaged file does to a run is one `error:` line naming the file, never a
traceback (`--debug` adds it); the files that were there stay as they were."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from forked_launch import launch_run
from mounts import full_disk, read_only_folder
from safetensors.torch import save_file

from modules.config.errors import ConfigError
from modules.config.presets import check_preset_name
from modules.errors import DiskFullError
from modules.util.atomic import write_with
from modules.saving.backup import BackupError, read_backup, write_backup

LONG_NAME = "a" * 300


def launch(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return launch_run(args, capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, **(env or {})},
                      **kwargs)


def tree(*folders: Path) -> dict[str, str]:
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest()
            for folder in folders if folder.exists() for path in sorted(folder.rglob("*")) if path.is_file()}


def one_error(result: subprocess.CompletedProcess) -> str:
    """The run failed with exactly one `error:` message (status lines may come before it) and no
    traceback; the message."""
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    starts = [index for index, line in enumerate(lines) if line.startswith("error: ")]
    assert len(starts) == 1, result.stderr
    return "\n".join(lines[starts[0]:])


@pytest.fixture
def config_file(tmp_path, tiny_model, shape_images) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model": {"base": str(tiny_model)}, "concepts": [{"path": str(shape_images)}],
                                "data": {"resolution": 64}, "adapter": {"rank": 4}, "tensorboard": False,
                                "train_device": "cpu", "workspace_dir": str(tmp_path / "ws"),
                                "output": {"path": str(tmp_path / "out" / "lora.safetensors")}}))
    return path


# --- read-only places and full disks ------------------------------------------------------------

def test_a_read_only_workspace_is_one_message(tmp_path, config_file):
    with read_only_folder(tmp_path / "ro", {"keep.txt": b"an earlier file"}) as read_only:
        before = tree(read_only)
        # training: found by the preflight, before the model loads
        message = one_error(launch("train", "--config", str(config_file), "--set", f"workspace_dir={read_only / 'ws'}"))
        assert message in (f"error: workspace_dir: cannot write in {read_only} (Read-only file system)",
                           f"error: workspace_dir: cannot write in {read_only} (Permission denied)")
        # any other command that writes there: launch.py's last net names the path
        message = one_error(launch("make-tiny-model", "--out", str(read_only / "tiny")))
        assert message.startswith(f"error: cannot write {read_only / 'tiny'}")
        assert message.endswith(("read-only file system", "permission denied"))
        assert tree(read_only) == before


def test_a_read_only_preset_folder_is_one_message(tmp_path, config_file):
    with read_only_folder(tmp_path / "home") as home:
        message = one_error(launch("presets", "save", "mine", "--config", str(config_file),
                                   env={"DIFFTRAINER_HOME": str(home)}))
        assert message.startswith(f"error: cannot write {home / 'presets' / 'mine.json'}: ")


def test_a_full_disk_is_named_as_such_through_the_cli(tmp_path, config_file):
    with full_disk(tmp_path / "home") as home:
        (home / "presets").mkdir()
        before = tree(home)
        message = one_error(launch("presets", "save", "mine", "--config", str(config_file),
                                   env={"DIFFTRAINER_HOME": str(home)}))
        assert message.startswith(f"error: disk full: cannot write {home / 'presets' / 'mine.json'} (")
        assert tree(home) == before  # no temp file left behind


def test_torch_save_on_a_full_disk_says_disk_full_and_keeps_the_backups(tmp_path):
    """torch.save's own words are a C++ message about inline_container.cc that never says why."""
    with full_disk(tmp_path / "disk", size="1m", leave_free=64 << 10) as disk:
        earlier = write_backup(disk, 1, {"w": torch.zeros(4)}, {"step": 1}, {}, rolling_count=3)
        before = tree(disk)
        with pytest.raises(DiskFullError) as caught:  # the adapter fits, the optimizer state does not
            write_backup(disk, 2, {"w": torch.zeros(4)}, {"step": 2, "state": torch.zeros(256 << 10)}, {}, 3)
        assert str(caught.value).startswith(f"disk full: cannot write {disk / 'backup'}")
        assert "inline_container.cc" in str(caught.value.__cause__)
        assert tree(disk) == before and read_backup(earlier)[1] == {"step": 1}


def test_safetensors_on_a_full_disk_says_disk_full_and_keeps_the_old_file(tmp_path):
    with full_disk(tmp_path / "disk", leave_free=16 << 10) as disk:
        target = disk / "lora.safetensors"
        save_file({"w": torch.ones(4)}, str(target))
        before = tree(disk)
        with pytest.raises(DiskFullError, match=rf"^disk full: cannot write {target} \(Error while serializing"):
            write_with(target, lambda temp: save_file({"w": torch.zeros(64 << 10)}, str(temp)))
        assert tree(disk) == before


# --- damaged files --------------------------------------------------------------------------------

def test_a_truncated_model_file_is_one_message_before_loading(tmp_path, tiny_model, config_file):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (weights,) = (model / "unet").glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:-1000])
    message = one_error(launch("train", "--config", str(config_file), "--set", f"model.base={model}"))
    assert message.startswith(f"error: model.parts.unet: {weights}: truncated: its header lists ")
    assert "[loading model]" not in message
    assert not (tmp_path / "ws").exists() and not (tmp_path / "out").exists()


class _Runs:  # a pickle that would call print("unpickled!") if it were ever unpickled
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_a_pickle_refused_by_weights_only_is_one_message(tmp_path, tiny_model, config_file):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    for path in (model / "text_encoder").glob("*.safetensors"):  # the first part to load
        path.unlink()
    pickled = model / "text_encoder" / "pytorch_model.bin"
    torch.save({"text_model.final_layer_norm.weight": _Runs()}, pickled)
    result = launch("train", "--config", str(config_file), "--set", f"model.base={model}")
    message = one_error(result)
    assert message.startswith(f"error: model.parts.text_encoder: {pickled} holds Python objects beyond tensors "
                              "(it names ")
    assert "print" in message and "unpickled!" not in result.stdout + result.stderr


def _backup(tmp_path: Path) -> Path:
    return write_backup(tmp_path, 3, {"w": torch.ones(8)}, {"step": 3}, {"seed": 1}, rolling_count=3)


def test_a_damaged_backup_names_itself_and_the_way_out(tmp_path):
    truncated = _backup(tmp_path / "a")
    adapter = truncated / "adapter.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:-8])
    with pytest.raises(BackupError, match=rf"^backup\.resume: {truncated} is damaged \(SafetensorError: .*; "
                                          rf"delete {truncated} to resume from the backup before it$"):
        read_backup(truncated)
    pickled = _backup(tmp_path / "b")
    torch.save({"step": _Runs()}, pickled / "state.pt")
    with pytest.raises(BackupError, match=rf"^backup\.resume: {pickled / 'state.pt'} holds Python objects beyond "
                                          rf"tensors .*; delete {pickled} to resume from the backup before it$"):
        read_backup(pickled)
    cut = _backup(tmp_path / "c")
    (cut / "state.pt").write_bytes((cut / "state.pt").read_bytes()[:100])
    with pytest.raises(BackupError, match=rf"^backup\.resume: {cut / 'state.pt'} is truncated or not a torch file"):
        read_backup(cut)


def test_a_damaged_remote_session_file_is_one_message(tmp_path):
    session = tmp_path / "remote-session.json"
    for damage in ('{"target": ', "[1, 2]", '{"target": {"host": "box", "colour": 1}, "remote_dir": "/r"}'):
        session.write_text(damage)
        message = one_error(launch("remote", "--attach", "--workspace", str(tmp_path)))
        assert message.startswith(f"error: --attach: {session} is damaged (")
        assert message.endswith("Restore the file, or delete it to start a new run")
        assert session.read_text() == damage


# --- the CLI itself -------------------------------------------------------------------------------

def test_a_reader_that_goes_away_ends_the_output_quietly():
    """`launch.py presets show X | head`: the pipe closes before everything is written."""
    reader, writer = os.pipe()
    os.close(reader)  # gone before the first write: every write hits a broken pipe
    try:
        result = subprocess.run([sys.executable, str(ROOT / "launch.py"), "presets", "show", "SD1.5 LoRA"],
                                stdout=writer, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)
    finally:
        os.close(writer)
    assert result.returncode == 141 and result.stderr == ""


def test_a_300_character_preset_name_is_one_message(tmp_path, config_file):
    home = tmp_path / "home"
    for args in (("save", LONG_NAME, "--config", str(config_file)), ("show", LONG_NAME)):
        message = one_error(launch("presets", *args, env={"DIFFTRAINER_HOME": str(home)}))
        assert f"preset name '{'a' * 40}...': is 300 characters long (at most 100)" in message
    assert not home.exists()


@pytest.mark.parametrize("name, problem", [
    ("", "is empty"), ("   ", "is empty"), ("a/b", "use letters"), ("a\\b", "use letters"), ("tab\there", "use letters"),
    (".hidden", "must not start with '.'"), (" padded", "must not start"), ("dot.", "end with '.'"),
    ("NUL", "device name"), ("com1.json", "device name"),
])
def test_invalid_preset_names_say_why(name, problem):
    with pytest.raises(ConfigError, match=problem):
        check_preset_name(name)


@pytest.mark.parametrize("name", ["SD1.5 LoRA", "Flux LoRA 24GB", "mine_v2-final", "Ölgemälde", "a" * 100])
def test_valid_preset_names_pass(name):
    check_preset_name(name)


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback_too(where):
    args = ["presets", "show", LONG_NAME]
    result = launch(*(["--debug", *args] if where == "before" else [*args, "--debug"]))
    assert result.returncode == 1 and "Traceback (most recent call last)" in result.stderr
    assert result.stderr.rstrip().endswith("is 300 characters long (at most 100)")
