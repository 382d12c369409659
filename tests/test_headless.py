"""Headless runs under signals and crashes, as real child processes: stop and resume, a second
Ctrl-C, kill -9 during a save, and resume refusing a run that changed under its backup."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, train_config
from forked_launch import launch_popen
from safetensors.torch import load_file

from modules.saving.backup import list_backups, read_backup
from modules.trainer.guards import TrainingError
from modules.trainer.resume import check_resume_compatible, resume_changes


def _train_child(config_file: Path, *extra: str) -> subprocess.Popen:
    return launch_popen(["train", "--config", str(config_file), "--protocol", "jsonl", *extra],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _temp_files(*folders: Path) -> list[Path]:
    return [p for folder in folders if folder.exists() for p in folder.rglob("*")
            if p.name.endswith(".tmp") or p.name.startswith(".tmp-")]


def test_sigterm_then_resume_gives_the_adapter_of_an_uninterrupted_run(tmp_path, quick_tiny_model, shape_images):
    from modules.cli.train_command import resolve_config, run_training
    from modules.trainer.callbacks import TrainCallbacks

    overlay = {"schedule": {"epochs": 4, "batch_size": 2}, "adapter": {"dropout": 0.1}}  # 8 steps; dropout uses the RNG
    straight = train_config(quick_tiny_model, shape_images, tmp_path / "straight", overlay)
    run_training(straight, TrainCallbacks())

    config = train_config(quick_tiny_model, shape_images, tmp_path / "split", overlay)
    config_file = tmp_path / "split.json"
    config_file.write_text(config.model_dump_json())
    process = _train_child(config_file)
    events = []
    for line in process.stdout:
        events.append(json.loads(line))
        if events[-1]["event"] == "progress" and events[-1]["step"] == 1:
            process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0, process.stderr.read()
    stopped_at = [e["step"] for e in events if e["event"] == "progress"][-1]
    assert stopped_at < 8 and [e["event"] for e in events].count("backup") == 1
    (backup,) = list_backups(Path(config.workspace_dir))
    assert read_backup(backup)[1]["step"] == stopped_at

    class Steps(TrainCallbacks):
        def __init__(self):
            self.steps = []

        def on_progress(self, progress):
            self.steps.append(progress.step)

    resumed = Steps()  # resumed here (as `launch.py train --resume` does): the backup carries all the state
    run_training(resolve_config([str(config_file)], None, [], resume=True), resumed)
    assert resumed.steps == list(range(stopped_at + 1, 9))

    expected, actual = load_file(straight.output.path), load_file(config.output.path)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.allclose(expected[key], actual[key], atol=1e-6, rtol=0), key
    # the half-way adapter differs, so the comparison above is not vacuous
    halfway = read_backup(backup)[0]
    assert any(not torch.equal(v, load_file(straight.output.path).get(k, v)) for k, v in halfway.items())


def test_a_second_sigint_quits_at_once_leaving_no_half_written_file(tmp_path, tiny_model, shape_images):
    # steps of 48 accumulated batches, a backup after each: step 2 must outlast reading the first
    # signal's answer, and 12 batches (~0.2 s) did not on an idle machine
    config = train_config(tiny_model, shape_images, tmp_path, {
        "concepts": [{"path": str(shape_images), "repeats": 12}],
        "schedule": {"epochs": 500, "batch_size": 1, "gradient_accumulation": 48, "backup_every": "1 steps"},
        "backup": {"rolling_count": 2}})
    config_file = tmp_path / "run.json"
    config_file.write_text(config.model_dump_json())
    process = _train_child(config_file)
    for line in process.stdout:
        if json.loads(line)["event"] == "backup":
            break  # step 1 and its backup are done; step 2 is starting
    time.sleep(0.2)
    process.send_signal(signal.SIGINT)  # during step 2: the run would stop after it
    for line in process.stderr:  # the first one is handled: it asks for a stop at the next step
        if "SIGINT: stopping at the next step" in line:
            break
    process.send_signal(signal.SIGINT)  # still in step 2: quit now
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    last = json.loads(out.splitlines()[-1])
    assert last["event"] == "error" and last["message"].startswith("interrupted at step"), last
    assert "Traceback" not in err
    assert last["message"].startswith("interrupted at step 1:")  # step 2 never finished
    workspace, output = Path(config.workspace_dir), Path(config.output.path)
    assert not output.exists()  # it quit before the final save rather than finishing it
    assert _temp_files(workspace, output.parent) == []
    for backup in list_backups(workspace):  # whatever backups exist are whole
        adapter, state, _ = read_backup(backup)
        assert adapter and state["step"] >= 1


def test_interrupt_inside_a_backup_leaves_no_partial_backup(tmp_path, monkeypatch):
    from modules.saving import backup as backup_module

    state = {"w": torch.ones(3)}
    good = backup_module.write_backup(tmp_path, 1, state, {"step": 1}, {}, rolling_count=3)

    def interrupted_save(*_args, **_kwargs):
        raise KeyboardInterrupt  # the second Ctrl-C arrives while state.pt is being written

    monkeypatch.setattr(backup_module.torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        backup_module.write_backup(tmp_path, 2, state, {"step": 2}, {}, rolling_count=3)
    assert list_backups(tmp_path) == [good]
    assert sorted(p.name for p in (tmp_path / "backup").iterdir()) == [good.name]


_SAVER = textwrap.dedent("""
    import sys, time
    import torch
    from safetensors.torch import save
    from modules.util.atomic import write_with

    target, phase = sys.argv[1], sys.argv[2]
    data = save({"lora_unet_x.lora_down.weight": torch.full((512, 512), 2.0)})

    def writer(temp):
        with open(temp, "wb") as handle:
            handle.write(data if phase == "written" else data[: len(data) // 2])
            handle.flush()
            print("in the save", flush=True)  # the parent kills -9 now: mid-write, or written but not renamed
            time.sleep(60)
            handle.write(b"" if phase == "written" else data[len(data) // 2:])

    write_with(target, writer)
""")


@pytest.mark.parametrize("phase", ["half", "written"])
def test_kill_9_during_a_save_leaves_the_previous_output_loadable(tmp_path, phase):
    from safetensors.torch import save_file

    target = tmp_path / "out" / "lora.safetensors"
    target.parent.mkdir()
    previous = {"lora_unet_x.lora_down.weight": torch.full((512, 512), 1.0)}
    save_file(previous, str(target))
    process = subprocess.Popen([sys.executable, "-c", _SAVER, str(target), phase], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert process.stdout.readline().strip() == "in the save", process.stderr.read()
    process.kill()
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    assert len(_temp_files(target.parent)) == 1  # the interrupted save's temp file: it really was mid-save
    loaded = load_file(str(target))
    assert torch.equal(loaded["lora_unet_x.lora_down.weight"], previous["lora_unet_x.lora_down.weight"])


def _backup_json(config) -> dict:
    return json.loads(config.model_dump_json())


@pytest.mark.parametrize("change, message", [
    ({"adapter": {"type": "loha"}}, "adapter.type: 'lora' in the backup, 'loha' now"),
    ({"adapter": {"dora": True}}, "adapter.dora: False in the backup, True now"),
    ({"adapter": {"type": "lokr", "factor": 4}}, "adapter.factor: -1 in the backup, 4 now"),
    ({"adapter": {"layer_preset": "all"}}, "adapter.layer_preset: 'attn-mlp' in the backup, 'all' now"),
    ({"adapter": {"alpha": 8}}, "adapter.alpha: 2.0 in the backup, 8.0 now"),
    ({"adapter": {"parts": {"unet": {"rank": 8}}}}, "adapter.parts.unet.rank: 4 in the backup, 8 now"),
    ({"model": {"parts": {"text_encoder": {"train": True}}}}, "model.parts.*.train: ['unet'] in the backup"),
    ({"model": {"parts": {"unet": {"path": "/elsewhere/unet"}}}}, "model.parts.unet.path: None in the backup"),
])
def test_resume_refuses_a_changed_adapter_or_model_naming_the_change(tmp_path, tiny_model, shape_images, change, message):
    backup = _backup_json(train_config(tiny_model, shape_images, tmp_path))
    changed = train_config(tiny_model, shape_images, tmp_path, change)
    with pytest.raises(TrainingError, match="cannot resume from .*the run changed") as error:
        check_resume_compatible(backup, changed, tmp_path / "backup" / "b")
    assert message in str(error.value)


def test_resume_accepts_changes_that_keep_the_adapter(tmp_path, tiny_model, shape_images):
    backup = _backup_json(train_config(tiny_model, shape_images, tmp_path))
    # more epochs, another lr, sampling, a per-part size equal to the global one, another base dtype
    same = train_config(tiny_model, shape_images, tmp_path, {
        "schedule": {"epochs": 9}, "optimizer": {"lr": 1e-3}, "adapter": {"parts": {"unet": {"rank": 4}}},
        "model": {"parts": {"unet": {"weight_dtype": "bfloat16"}}}})
    assert resume_changes(backup, same) == []
    other_model = train_config(tiny_model.parent, shape_images, tmp_path)
    expected = f"model.base: {str(tiny_model)!r} in the backup, {str(tiny_model.parent)!r} now"
    assert resume_changes(backup, other_model) == [expected]


def test_resume_reads_a_backup_config_that_predates_a_field_as_its_default(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path)
    backup = _backup_json(config)
    for field in ("dora", "parts"):
        del backup["adapter"][field]
    assert resume_changes(backup, config) == []
    assert resume_changes(backup, train_config(tiny_model, shape_images, tmp_path, {"adapter": {"dora": True}})) == \
        ["adapter.dora: False in the backup, True now"]
