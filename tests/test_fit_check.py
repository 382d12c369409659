"""Preflight refuses a run that cannot fit its train device (issue 25 item 3), from the plan
(modules/plan/), before the model loads: on the fake device with a small capacity the refusal
names the planned peak, what is free, the parts and the `--set` fixes; with room, or on the CPU
(no free figure), nothing is refused."""

from __future__ import annotations

import pytest
import torch

from conftest import train_config


def test_a_run_over_the_fake_devices_free_memory_is_refused(fake_device, tiny_model, shape_images, tmp_path):
    from modules.trainer.preflight import run_preflight

    config = train_config(tiny_model, shape_images, tmp_path, {"train_device": "fakegpu"})
    torch.fakegpu.set_memory_capacity(torch.fakegpu.memory_allocated() + 2**16)  # 64 KiB free
    try:
        with pytest.raises(Exception) as caught:
            run_preflight(config)
    finally:
        torch.fakegpu.set_memory_capacity(None)
    message = str(caught.value)
    assert "train_device: the run does not fit on fakegpu: its planned peak is " in message
    assert "0.00 GiB is free (" in message and "unet " in message
    assert "to fit, add:\n    --set " in message or "makes it fit here" in message
    run_preflight(config)  # no capacity: the same config passes


def test_a_device_with_room_for_many_times_the_model_is_not_planned(monkeypatch, tiny_model, shape_images, tmp_path):
    import modules.plan.run_plan as run_plan
    from modules.trainer import fit_check

    config = train_config(tiny_model, shape_images, tmp_path, {"train_device": "fakegpu"})
    monkeypatch.setattr(fit_check, "free_device_memory", lambda device: 2**40)  # the fake device unbounded
    monkeypatch.setattr(run_plan, "plan_run", lambda *a, **k: pytest.fail("planned a run that surely fits"))
    assert fit_check.fit_problem(config, torch.device("cpu")) is None
    assert not fit_check.surely_fits(config, 2**30)  # 1 GiB is not 8x SD1.5's 4.3 GB of float32 weights


def test_the_cpu_has_no_free_figure_so_nothing_is_refused():
    from modules.trainer.fit_check import free_device_memory

    assert free_device_memory(torch.device("cpu")) is None


def test_the_refusal_reads_the_plan():
    from modules.trainer.fit_check import refusal

    G = 2**30
    plan = {"device": {"peak": 14 * G, "budget": 12 * G}, "budget": {"vram": 12 * G, "ram": 8 * G},
            "host": {"load_peak": 10 * G, "train_peak": 6 * G},
            "parts": {"vae": {"device": {"total": G}}, "transformer": {"device": {"total": 13 * G}}},
            "fixes": ["--set model.parts.transformer.offload_fraction=0.5"]}
    assert refusal(plan, "cuda:0") == (
        "train_device: the run does not fit on cuda:0: its planned peak is 14.00 GiB, 12.00 GiB is free "
        "(transformer 13.00 GiB, vae 1.00 GiB); the host needs 10.00 GiB while loading and 6.00 GiB while "
        "training, 8.00 GiB is available; to fit, add:\n    --set model.parts.transformer.offload_fraction=0.5")
