"""--resume from a backup that is damaged or incomplete: one message naming the file at fault and
the way out, before anything trains, and nothing in the workspace changes.

An incomplete newest backup (a file of it missing: copied or synced in part, a file deleted) is
refused, not passed over for the one before it: that would quietly train its steps again, and the
user more likely wants the missing file put back than those steps repeated."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from conftest import train_config

from modules.cli.train_command import run_training
from modules.saving.backup import BackupError, list_backups, newest_backup
from modules.trainer.callbacks import TrainCallbacks

# one step (4 images, batch 4), a backup after it
OVERLAY = {"schedule": {"epochs": 1, "batch_size": 4, "backup_every": "1 epochs"}}


@pytest.fixture(scope="module")
def backed_up(tmp_path_factory, tiny_model, shape_images) -> Path:
    """The folder of a finished one-step run with its backup, and a copy of it named as an older
    backup (tests copy the folder)."""
    root = tmp_path_factory.mktemp("damaged-backups")
    run_training(train_config(tiny_model, shape_images, root, OVERLAY), TrainCallbacks())
    (backup,) = list_backups(root / "ws")
    shutil.copytree(backup, backup.with_name("20000101-000000-step0000001"))
    return root


@pytest.fixture
def workspace(backed_up, tmp_path) -> Path:
    shutil.copytree(backed_up, tmp_path / "run")
    return tmp_path / "run"


def _files(folder: Path) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def _resume_error(root: Path, tiny_model, shape_images) -> str:
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_model, shape_images, root, OVERLAY, {"backup": {"resume": True}})
    backups = _files(root / "ws" / "backup")
    trainer = GenericTrainer(config, TrainCallbacks())
    try:
        with pytest.raises(BackupError) as caught:
            trainer.start()
        assert trainer.step == 0
    finally:
        trainer.release()
    assert _files(root / "ws" / "backup") == backups
    return str(caught.value)


@pytest.mark.parametrize("lost", ["state.pt", "adapter.safetensors"])
def test_an_incomplete_newest_backup_is_refused_naming_it_and_the_one_before(workspace, tiny_model, shape_images,
                                                                              lost):
    older, newest = list_backups(workspace / "ws")
    (newest / lost).unlink()
    assert _resume_error(workspace, tiny_model, shape_images) == (
        f"backup.resume: the newest backup {newest} is incomplete: it lacks {lost} (copied or synced in part, or a "
        f"file deleted?). Put the missing file back to resume from it, or delete {newest} to resume from the "
        f"backup before it ({older.name})")
    shutil.rmtree(newest)  # the way out the message gives
    assert newest_backup(workspace / "ws") == older


def test_an_incomplete_only_backup_says_the_resume_would_start_at_step_0(tmp_path):
    folder = tmp_path / "backup" / "20260101-120000-step0000004"
    folder.mkdir(parents=True)
    (folder / "adapter.safetensors").write_bytes(b"")
    with pytest.raises(BackupError, match=r"it lacks state\.pt, config\.json .* to resume from step 0 \(no complete"):
        newest_backup(tmp_path)
    assert list_backups(tmp_path) == []  # (nor does the rolling count ever prune it)


def test_a_state_pt_without_the_training_state_is_refused_with_the_way_out(workspace, tiny_model, shape_images):
    newest = list_backups(workspace / "ws")[-1]
    torch.save({}, newest / "state.pt")
    assert _resume_error(workspace, tiny_model, shape_images) == (
        f"backup.resume: {newest / 'state.pt'} is not a training state this trainer wrote (it lacks optimizer, "
        f"scheduler, generator, torch_rng, step, epoch, batch_in_epoch); delete {newest} to resume from the "
        "backup before it")


def test_a_state_pt_whose_parts_do_not_load_is_refused_with_the_way_out(workspace, tiny_model, shape_images):
    newest = list_backups(workspace / "ws")[-1]
    state = torch.load(newest / "state.pt", weights_only=True)
    torch.save({**state, "optimizer": {}}, newest / "state.pt")
    assert _resume_error(workspace, tiny_model, shape_images).startswith(
        f"backup.resume: {newest / 'state.pt'}: its optimizer state does not fit this run (KeyError: ")
    torch.save({**state, "step": "2"}, newest / "state.pt")
    assert "(it holds str as 'step', not a whole number >= 0)" in _resume_error(workspace, tiny_model, shape_images)


@pytest.mark.parametrize("text, problem", [
    ("[]", "{config} holds list, not the JSON object of a config (damaged?)"),
    ('{"model": []}', "{config} is not a config this trainer wrote (model is list, not an object)"),
    ('{"model": {"parts": {"unet": true}}}', "{config} is not a config this trainer wrote (model.parts.unet is bool, "
                                            "not an object)"),
    ('{"version": 99}', "{config} is not a config this trainer wrote (version: 99 is newer than this trainer "
                        "understands (2); update the trainer)"),
    ("{", "{folder} is damaged (JSONDecodeError: Expecting property name enclosed in double quotes: line 1 "
          "column 2 (char 1))"),
])
def test_a_damaged_backup_config_is_refused_before_the_model_loads(workspace, tiny_model, shape_images, text,
                                                                   problem, monkeypatch):
    from modules.trainer import generic_trainer

    newest = list_backups(workspace / "ws")[-1]
    (newest / "config.json").write_text(text)
    monkeypatch.setattr(generic_trainer, "get_family_class", lambda name: pytest.fail("the model was loaded"))
    problem = problem.format(config=newest / "config.json", folder=newest)
    assert _resume_error(workspace, tiny_model, shape_images) == (
        f"backup.resume: {problem}; delete {newest} to resume from the backup before it")
