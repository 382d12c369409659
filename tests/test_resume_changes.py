"""Resuming into a changed config: every change is reported; a changed lr or LR schedule takes
effect from the resumed step (the optimizer's moments are kept); a changed optimizer type is refused
with the reason, through the CLI, and no backup changes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import ROOT, train_config
from forked_launch import launch_run

from modules.cli.train_command import run_training
from modules.trainer.callbacks import TrainCallbacks

# two steps (4 images, batch 4, two epochs), a backup after each epoch
OVERLAY = {"schedule": {"epochs": 2, "batch_size": 4, "backup_every": "1 epochs"}, "optimizer": {"lr": 5e-3}}


@pytest.fixture(scope="module")
def backed_up(tmp_path_factory, tiny_model, shape_images) -> Path:
    """The folder of a finished two-step run with its backups (tests only read it)."""
    root = tmp_path_factory.mktemp("resume-changes")
    run_training(train_config(tiny_model, shape_images, root, OVERLAY), TrainCallbacks())
    return root


class Warnings(TrainCallbacks):
    def __init__(self):
        self.warnings = []

    def on_warning(self, message):
        self.warnings.append(message)


def _resumed_trainer(root: Path, tiny_model, shape_images, change: dict):
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_model, shape_images, root, OVERLAY, change, {"backup": {"resume": True}})
    callbacks = Warnings()
    trainer = GenericTrainer(config, callbacks)
    try:
        trainer.start()
    finally:
        trainer.release()
    return trainer, callbacks.warnings


def test_a_changed_lr_applies_from_the_resumed_step_and_every_change_is_reported(backed_up, tiny_model, shape_images):
    trainer, warnings = _resumed_trainer(backed_up, tiny_model, shape_images,
                                         {"optimizer": {"lr": 1e-3}, "loss": {"noise_offset": 0.05}})
    assert trainer.step == 2
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [1e-3]
    assert trainer.scheduler.get_last_lr() == [1e-3]
    # the optimizer's own state came from the backup
    state = trainer.optimizer.state[trainer.optimizer.param_groups[0]["params"][0]]
    assert int(state["step"]) == 2 and state["exp_avg"].abs().sum() > 0
    (report,) = [w for w in warnings if w.startswith("resume: changed since the backup")]
    assert "optimizer.lr: 0.005 -> 0.001" in report and "loss.noise_offset: 0.0 -> 0.05" in report
    assert "backup.resume" not in report


def test_a_changed_schedule_applies_at_the_resumed_step(backed_up, tiny_model, shape_images):
    # linear decay over four steps: at step 2 the factor is 1 - 2/4
    trainer, warnings = _resumed_trainer(backed_up, tiny_model, shape_images,
                                         {"lr_scheduler": {"type": "linear"}, "schedule": {"epochs": 4}})
    assert trainer.total_steps == 4
    assert trainer.scheduler.get_last_lr() == pytest.approx([5e-3 * 0.5])
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx([5e-3 * 0.5])
    assert any("lr_scheduler.type: 'constant' -> 'linear'" in w for w in warnings)


def _files(folder: Path) -> dict:
    return {p: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def test_a_changed_optimizer_type_is_refused_with_the_reason(backed_up, tiny_model, shape_images, tmp_path):
    config = json.loads(train_config(tiny_model, shape_images, backed_up, OVERLAY).model_dump_json())
    config["optimizer"] = {"type": "prodigy", "lr": 1.0}
    config_file = tmp_path / "prodigy.json"
    config_file.write_text(json.dumps(config))
    backups, output = Path(config["workspace_dir"]) / "backup", Path(config["output"]["path"])
    before = {**_files(backups), **_files(output.parent)}
    result = launch_run(["train", "--config", str(config_file), "--resume"],
                        capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert result.returncode == 1
    assert "optimizer.type: 'adamw' in the backup, 'prodigy' now" in result.stderr
    assert "belongs to adamw" in result.stderr and "adapter.init_from" in result.stderr
    assert "KeyError" not in result.stderr and "Traceback" not in result.stderr
    assert {**_files(backups), **_files(output.parent)} == before


def test_resume_compares_the_dora_axis_it_resolves_to_and_the_oft_constraint():
    """A backup from before `dora_axis: auto` says "output"; resumed with auto into a kohya file
    that is the input axis (a different adapter), into a diffusers file the same one."""
    from modules.config.loading import build_config
    from modules.trainer.resume import resume_changes

    def config(format="kohya", **adapter):
        return build_config([{"adapter": adapter, "output": {"format": format}}])

    old = json.loads(config(dora=True, dora_axis="output").model_dump_json())
    assert any(line.startswith("adapter.dora_axis: 'output' in the backup, 'input' now")
               for line in resume_changes(old, config(dora=True)))
    old_diffusers = json.loads(config(dora=True, dora_axis="output", format="diffusers").model_dump_json())
    assert not resume_changes(old_diffusers, config(dora=True, format="diffusers"))
    old_oft = json.loads(config(type="oft").model_dump_json())
    assert any(line.startswith("adapter.constraint") for line in resume_changes(old_oft, config(type="oft", constraint=0.5)))


def test_resume_refuses_changed_trained_embeddings_before_the_model_loads():
    """The backup holds one tensor per trained placeholder: another placeholder, another vector
    count or one more trained embedding cannot follow; a changed learning rate or init text can."""
    from modules.config.loading import build_config
    from modules.trainer.resume import resume_changes

    def config(*embeddings):
        return build_config([{"embeddings": list(embeddings)}])

    old = json.loads(config({"placeholder": "<a>", "vectors": 2}).model_dump_json())
    assert not resume_changes(old, config({"placeholder": "<a>", "vectors": 2, "learning_rate": 1e-3, "init_text": "x"}))
    for changed in ([{"placeholder": "<a>", "vectors": 3}], [{"placeholder": "<b>", "vectors": 2}],
                    [{"placeholder": "<a>", "vectors": 2}, {"placeholder": "<c>"}], []):
        lines = resume_changes(old, config(*changed))
        assert any(line.startswith("embeddings: trained ['<a> x 2'] in the backup") for line in lines), changed


def test_a_fine_tune_resume_ignores_the_adapter_settings_it_does_not_use():
    """issue 31: a fine-tune's `--resume --set adapter.rank=8` was refused over an adapter it never
    builds; an adapter run still refuses the same change (the backup holds rank-16 tensors)."""
    from modules.config.loading import build_config
    from modules.trainer.resume import resume_changes

    fine_tune = [{"method": {"type": "fine_tune"}}]
    old = json.loads(build_config(fine_tune).model_dump_json())
    assert resume_changes(old, build_config(fine_tune, ["adapter.rank=8", "adapter.layer_preset=all"])) == []
    old_adapter = json.loads(build_config([]).model_dump_json())
    lines = resume_changes(old_adapter, build_config([], ["adapter.rank=8"]))
    assert any(line.startswith("adapter.rank: 16 in the backup, 8 now") for line in lines), lines
