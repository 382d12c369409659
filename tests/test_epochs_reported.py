"""Progress counts the epochs a run will reach: a run that schedule.max_steps stops early (the
demo: 100 epochs configured, 50 steps) reports "epoch 13/13", not "13/100", and says at its start
where max_steps ends it."""

from __future__ import annotations

from conftest import train_config
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer


class Recorded(TrainCallbacks):
    def __init__(self):
        self.progress, self.status = [], []

    def on_progress(self, p):
        self.progress.append(p)

    def on_status(self, text):
        self.status.append(text)


def _run(tiny_model, shape_images, tmp_path, schedule):
    callbacks = Recorded()
    trainer = GenericTrainer(train_config(tiny_model, shape_images, tmp_path, {"schedule": schedule}), callbacks)
    try:
        trainer.start()
        trainer.train()
    finally:
        trainer.release()
    return trainer, callbacks


def test_a_run_max_steps_stops_reports_the_epochs_it_reaches(tiny_model, shape_images, tmp_path):
    trainer, callbacks = _run(tiny_model, shape_images, tmp_path, {"epochs": 100, "max_steps": 3, "batch_size": 1})
    per_epoch = trainer.steps_per_epoch
    reached = -(-3 // per_epoch)
    assert reached < 100
    assert {p.epochs for p in callbacks.progress} == {reached}
    assert (f"schedule.max_steps: 3 steps end the run in epoch {reached} of schedule.epochs 100 "
            f"({per_epoch} steps an epoch)") in callbacks.status


def test_a_run_that_ends_with_its_epochs_reports_them(tiny_model, shape_images, tmp_path):
    _, callbacks = _run(tiny_model, shape_images, tmp_path, {"epochs": 1, "max_steps": 500, "batch_size": 2})
    assert {p.epochs for p in callbacks.progress} == {1}
    assert not [line for line in callbacks.status if line.startswith("schedule.max_steps")]
