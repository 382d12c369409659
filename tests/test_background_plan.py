"""The plan made beside the load where preflight skips it (modules/trainer/background_plan.py): a
plan that fails in its child process is said as a warning and the run trains on; a run that stops
while the child plans ends it at once. (That the memory event carries the child's plan:
tests/test_memory_report.py.)"""

from __future__ import annotations

import time

import pytest

from conftest import train_config
from modules.trainer.callbacks import TrainCallbacks

# imported by the child's interpreter at start (PYTHONPATH): its planner raises
FAILING_PLANNER = '''
import modules.plan.run_plan as run_plan

def plan_run(*args, **kwargs):
    raise ValueError("a planner bug\\nits second line")

run_plan.plan_run = plan_run
'''


pytestmark = pytest.mark.background_plan


class Recorder(TrainCallbacks):
    def __init__(self):
        self.memory, self.warnings = [], []

    def on_memory(self, report):
        self.memory.append(report)

    def on_warning(self, message):
        self.warnings.append(message)


def test_a_plan_that_fails_is_a_warning_and_the_run_goes_on(fake_device, tiny_model, shape_images, tmp_path,
                                                             monkeypatch):
    from modules.trainer import memory_report
    from modules.trainer.generic_trainer import GenericTrainer

    (tmp_path / "child").mkdir()
    (tmp_path / "child" / "sitecustomize.py").write_text(FAILING_PLANNER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "child"))
    monkeypatch.setattr(memory_report, "REPORT_PLAN_WAIT_S", 300.0)  # the failure, however slow the box
    config = train_config(tiny_model, shape_images, tmp_path, {"train_device": "fakegpu",
                                                               "schedule": {"epochs": 4, "max_steps": 2}})
    recorder = Recorder()
    trainer = GenericTrainer(config, recorder)
    trainer.start()
    trainer.train()
    assert trainer.end() is not None  # trained and saved
    report = recorder.memory[0]
    assert "planned" not in report
    assert report["unplanned"] == "the plan made beside the run failed: ValueError: a planner bug"
    assert ("memory: the plan made beside the run failed: ValueError: a planner bug; the run goes on without it"
            in recorder.warnings)


def test_a_run_stopped_while_the_plan_is_made_ends_the_child_at_once(fake_device, tiny_model, shape_images, tmp_path):
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_model, shape_images, tmp_path, {"train_device": "fakegpu"})
    trainer = GenericTrainer(config, Recorder())
    trainer.commands.stop()  # Stop before the first step: the start ends after the load
    trainer.start()
    child = trainer.background_plan._process
    assert child.poll() is None  # still importing torch, let alone planning
    started = time.monotonic()
    trainer.end()  # nothing trained; release() stops the child
    assert time.monotonic() - started < 5
    assert child.poll() is not None and trainer.background_plan.result() == (None, "was stopped before it was made")


def test_a_planning_process_that_cannot_start_is_a_failure_said_not_raised(tiny_model, shape_images, tmp_path,
                                                                          monkeypatch):
    import torch

    from modules.trainer import background_plan

    def no_process(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(background_plan.subprocess, "Popen", no_process)
    plan = background_plan.BackgroundPlan(train_config(tiny_model, shape_images, tmp_path), torch.device("cpu"),
                                          2**40, None)
    assert plan.result() == (None, "failed: the planning process did not start "
                                   "([Errno 11] Resource temporarily unavailable)")
    plan.close()  # (what release() does) nothing to stop



# imported by the child's interpreter at start (PYTHONPATH): a planner that asks CUDA something, as a
# careless change to the plan's path would
PLANNER_ASKS_CUDA = '''
import torch
import modules.plan.run_plan as run_plan

planned = run_plan.plan_run

def plan_run(*args, **kwargs):
    torch.cuda.current_device()
    return planned(*args, **kwargs)

run_plan.plan_run = plan_run
'''


def _plan_a_cuda_run_in_the_child(tiny_model, shape_images, tmp_path, monkeypatch, sitecustomize: str = ""):
    """(plan, why none, the child's environment) of a run on cuda:0 planned in the child."""
    import torch

    from modules.trainer import background_plan

    (tmp_path / "child").mkdir()
    (tmp_path / "child" / "sitecustomize.py").write_text(sitecustomize)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "child"))
    environments = []
    popen = background_plan.subprocess.Popen

    def recording_popen(*args, **kwargs):
        environments.append(kwargs["env"])
        return popen(*args, **kwargs)

    monkeypatch.setattr(background_plan.subprocess, "Popen", recording_popen)
    plan = background_plan.BackgroundPlan(train_config(tiny_model, shape_images, tmp_path), torch.device("cuda:0"),
                                          2**40, 2**40)
    try:
        return (*plan.result(wait_s=300), environments[0])  # (however slow the box)
    finally:
        plan.close()


def test_the_planning_child_plans_a_cuda_run_with_cuda_hidden_and_never_started(tiny_model, shape_images, tmp_path,
                                                                                  monkeypatch):
    """A CUDA context in the child would take ~500 MiB of the card from the run: the child sees no
    GPU (bitsandbytes' import, through diffusers', asks the device's capability where one is
    visible: a context), and nothing on its path (imports, config, plan) starts CUDA."""
    plan, unplanned, environment = _plan_a_cuda_run_in_the_child(tiny_model, shape_images, tmp_path, monkeypatch)
    assert environment["CUDA_VISIBLE_DEVICES"] == ""
    assert unplanned is None
    assert plan["device"]["step"] > 0


def test_a_cuda_start_in_the_planning_child_fails_its_plan_saying_why(tiny_model, shape_images, tmp_path, monkeypatch):
    from modules.trainer.background_plan import CUDA_STARTED

    plan, unplanned, _ = _plan_a_cuda_run_in_the_child(tiny_model, shape_images, tmp_path, monkeypatch,
                                                       PLANNER_ASKS_CUDA)
    assert plan is None
    assert unplanned == f"failed: RuntimeError: {CUDA_STARTED.format(how='torch.cuda._lazy_init')}"
