"""The measured `memory` event (issue 25 item 3): once, after a run's second optimizer step, the
train device's peak (the fake device's counters here; CUDA's on a GPU) and the host's peak RSS.
Runs on the tiny model, on the fake device and on the CPU; the event's wire form and its one
console line without a run."""

from __future__ import annotations

import io
import json

import pytest

from conftest import train_config
from modules.trainer.callbacks import TrainCallbacks

STEPS = 3  # the report comes after step 2, never again at step 3


class Recorder(TrainCallbacks):
    def __init__(self):
        self.memory: list[dict] = []
        self.steps_seen_at_report: list[int] = []
        self.steps: list[int] = []

    def on_progress(self, progress):
        self.steps.append(progress.step)

    def on_memory(self, report):
        self.memory.append(report)
        self.steps_seen_at_report.append(self.steps[-1])


def trained_run(model, images, folder, device: str, max_steps: int = STEPS):
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(model, images, folder, {"train_device": device,
                                                  "schedule": {"epochs": 4, "max_steps": max_steps}})
    recorder = Recorder()
    trainer = GenericTrainer(config, recorder)
    trainer.start()
    trainer.train()
    trained_bytes = sum(p.numel() * p.element_size() for p in trainer.trained_parameters())
    trainer.end()
    return recorder, trained_bytes


def test_fake_device_reports_its_peak_once_after_step_two(fake_device, tiny_model, shape_images, tmp_path):
    import torch

    # a capacity the plan is asked about (far more room is not planned: fit_check.surely_fits)
    torch.fakegpu.set_memory_capacity(torch.fakegpu.memory_allocated() + 2**30)
    try:
        recorder, trained_bytes = trained_run(tiny_model, shape_images, tmp_path, "fakegpu")
    finally:
        torch.fakegpu.set_memory_capacity(None)
    assert recorder.steps[-1] == STEPS
    assert len(recorder.memory) == 1 and recorder.steps_seen_at_report == [2]
    report = recorder.memory[0]
    assert report["step"] == 2
    measured = report["measured"]
    assert measured["device"].startswith("fakegpu")
    # the base weights, the adapter, its gradients and Adam's two moments all sit on the device
    assert measured["device_peak_allocated"] >= 4 * trained_bytes > 0
    # the fake device has no caching allocator, so no reserved figure
    assert measured["device_peak_reserved"] is None
    # the peak is the training's: below what the device held at most in the whole process is fine,
    # above what it holds now (the step's activations and gradients are gone after the step)
    assert measured["device_peak_allocated"] >= torch.fakegpu.memory_allocated()
    assert measured["host_peak_rss"] >= measured["host_rss"] > trained_bytes
    # the baseline the plan's host figures grow from: the resident size as the load began
    assert 0 < measured["host_rss_before_load"] < measured["host_peak_rss"]
    # beside the plan preflight made before loading: within the planner's 10%
    planned = report["planned"]
    assert abs(planned["device_peak"] / measured["device_peak_allocated"] - 1) <= 0.10
    assert planned["host_load_peak"] > 0


def test_cpu_run_reports_the_host_only(tiny_model, shape_images, tmp_path):
    recorder, trained_bytes = trained_run(tiny_model, shape_images, tmp_path, "cpu", max_steps=1)
    # a run shorter than two steps reports after its last
    assert recorder.steps_seen_at_report == [1]
    assert "planned" not in recorder.memory[0]  # the CPU cannot say what is free: nothing was planned
    measured = recorder.memory[0]["measured"]
    assert measured["device"] == "cpu"
    assert measured["device_peak_allocated"] is None and measured["device_peak_reserved"] is None
    assert measured["host_peak_rss"] >= measured["host_rss"] > trained_bytes


REPORT = {"step": 2, "measured": {"device": "cuda:0", "device_peak_allocated": 3 * 2**30,
                                  "device_peak_reserved": 3.5 * 2**30, "host_peak_rss": 12 * 2**30,
                                  "host_rss": 10 * 2**30}}


def test_jsonl_event_and_its_remote_dispatch():
    from modules.remote.cli import dispatch
    from modules.trainer.event_protocol import JsonlEvents

    stream = io.StringIO()
    JsonlEvents(stream).on_memory(REPORT)
    event = json.loads(stream.getvalue())
    assert event == {"event": "memory", **REPORT}
    received = Recorder()
    received.steps = [2]
    dispatch(event, received)  # a remote run's event reaches the local console
    assert received.memory == [REPORT]


def test_console_prints_one_line():
    from modules.cli.console import ConsoleCallbacks

    stream = io.StringIO()
    ConsoleCallbacks(stream).on_memory(REPORT)
    assert stream.getvalue() == ("memory after step 2: cuda:0 peak 3.00 GiB allocated, 3.50 GiB reserved; "
                                 "host peak 12.00 GiB resident\n")


@pytest.mark.parametrize("measured, line", [
    ({"device": "cpu", "host_peak_rss": 3 * 2**30, "host_rss_before_load": 2**30},
     "host peak 3.00 GiB resident, 2.00 GiB over the start of the load"),
    ({"device": "cpu", "device_peak_allocated": None, "host_peak_rss": 2**30}, "host peak 1.00 GiB resident"),
    ({"device": "cpu"}, "not measurable here"),
])
def test_the_line_says_what_was_measured(measured, line):
    from modules.trainer.memory_report import describe_memory

    assert describe_memory({"step": 2, "measured": measured}) == f"memory after step 2: {line}"


@pytest.mark.background_plan
def test_a_device_that_surely_fits_reports_the_plan_made_beside_the_load(fake_device, tiny_model, shape_images,
                                                                         tmp_path, monkeypatch):
    import torch

    import modules.plan.run_plan as run_plan
    from modules.trainer import fit_check, memory_report

    # no capacity: the fake device says 1 TiB is free, SURELY_FITS times SD1.5's float32 weights and far more,
    # so preflight plans nothing (in this process: planning here fails the test) and the child plans instead
    assert fit_check.surely_fits(train_config(tiny_model, shape_images, tmp_path), torch.fakegpu.mem_get_info()[0])
    monkeypatch.setattr(run_plan, "plan_run", lambda *a, **k: pytest.fail("planned in the training process"))
    # the child imports torch and plans at a low priority: on a busy CPU-only test box that can outlast
    # these few tiny steps, where a GPU run's load and caching take longer than the plan
    monkeypatch.setattr(memory_report, "REPORT_PLAN_WAIT_S", 300.0)
    recorder, _ = trained_run(tiny_model, shape_images, tmp_path, "fakegpu")
    report = recorder.memory[0]
    assert "unplanned" not in report
    planned = report["planned"]
    assert abs(planned["device_peak"] / report["measured"]["device_peak_allocated"] - 1) <= 0.10
    assert planned["host_load_peak"] > 0


def test_the_line_says_why_a_plan_made_beside_the_run_is_missing():
    from modules.trainer.memory_report import describe_memory

    report = {"step": 2, "measured": {"device": "cpu", "host_peak_rss": 2**30},
              "unplanned": "the plan made beside the run was not ready after 40 s"}
    assert describe_memory(report) == ("memory after step 2: host peak 1.00 GiB resident; "
                                       "no plan: the plan made beside the run was not ready after 40 s")
