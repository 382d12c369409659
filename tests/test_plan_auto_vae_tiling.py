"""`sampling.vae_tiling: auto` (modules/plan/auto.py, resolve_auto_vae_tiling): tiled only where the
untiled sample decode sets the device peak over the budget and tiling lowers it. Tiny FLUX.1 at a
128 px sample with 32 px tiles: its decode sets the peak (over caching 64 px images)."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config

RUN = {"data": {"resolution": 64}, "schedule": {"epochs": 1, "batch_size": 1, "max_steps": 1},
       "sampling": {"prompts": [{"prompt": "a red circle", "steps": 2, "width": 128, "height": 128}]}}


@pytest.fixture
def flux_config(fake_device, tmp_path, tiny_family_model, shape_images, monkeypatch):
    from modules.sampling import vae_tiling

    monkeypatch.setattr(vae_tiling, "KL_TILE_PIXELS", 32)

    def make(tiling="auto", prompts=True):
        run = RUN if prompts else {**RUN, "sampling": {"prompts": []}}
        return train_config(tiny_family_model("flux"), shape_images, tmp_path, run, {
            "model": {"family": "flux"}, "train_device": str(fake_device), "sampling": {"vae_tiling": tiling}})
    return make


def test_auto_tiles_only_where_the_whole_decode_does_not_fit(flux_config):
    from modules.plan.run_plan import Planner, plan_run

    planner = Planner(flux_config())
    whole = plan_run(flux_config(False), None, None, planner=planner)
    tiled = plan_run(flux_config(True), None, None, planner=planner)
    assert whole.device_peak == whole.outside_step_phases["sampling"] > tiled.device_peak  # the decode sets it

    def chosen(vram):
        plan = plan_run(flux_config(), vram, None, planner=planner, fix=False)
        return plan.auto["sampling.vae_tiling"], plan

    between = (whole.device_peak + tiled.device_peak) // 2
    choice, plan = chosen(between)
    assert choice["value"] is True, choice
    assert plan.device_peak == tiled.device_peak and plan.fits  # the plan is the tiled one
    assert chosen(whole.device_peak + 1)[0]["value"] is False  # the whole decode fits: untiled
    assert chosen(tiled.device_peak // 2)[0]["value"] is True  # nothing fits, but tiling lowers the peak
    choice, plan = chosen(None)
    assert choice == {"value": False, "why": "no train-device budget known here (the CPU)"}
    assert plan.device_peak == whole.device_peak


def test_auto_stays_untiled_where_tiling_does_not_lower_the_peak(flux_config, monkeypatch):
    """A sample decode that a tile does not shrink (the tile larger than the sample) leaves the
    denoiser's or the decode's whole peak: untiled, said why."""
    from modules.plan.run_plan import plan_run
    from modules.sampling import vae_tiling

    monkeypatch.setattr(vae_tiling, "KL_TILE_PIXELS", 1024)
    whole = plan_run(flux_config(False), None, None)
    choice = plan_run(flux_config(), whole.device_peak // 2, None, fix=False).auto["sampling.vae_tiling"]
    assert choice["value"] is False and "would not lower" in choice["why"]


def test_a_run_without_a_budget_decodes_whole_and_says_why(flux_config):
    """The trainer's resolution (trainer/planned_autos.py) on a device without a free figure; without a
    sample prompt there is nothing to choose and auto is left alone."""
    from types import SimpleNamespace

    from modules.trainer.planned_autos import resolve_planned_autos

    said = []
    ranks = SimpleNamespace(main=True, world=1)
    config = flux_config().model_copy(update={"train_device": "cpu"})
    resolved, plan = resolve_planned_autos(config, torch.device("cpu"), ranks, said.append)
    assert resolved.sampling.vae_tiling is False and plan is None
    assert "sampling.vae_tiling: auto -> false (no train-device budget known here (the CPU))" in said
    untouched, _ = resolve_planned_autos(flux_config(prompts=False), torch.device("cpu"), ranks, said.append)
    assert untouched.sampling.vae_tiling == "auto"


def test_a_run_with_a_budget_takes_the_plans_choice_and_logs_it(flux_config, fake_device, monkeypatch):
    """The trainer's resolution against the device's free memory: between the tiled and the whole
    decode's peaks the run samples tiled, and its log says so and why."""
    from types import SimpleNamespace

    from modules.plan.run_plan import plan_run
    from modules.trainer import fit_check
    from modules.trainer.planned_autos import resolve_planned_autos

    whole = plan_run(flux_config(False), None, None).device_peak
    tiled = plan_run(flux_config(True), None, None).device_peak
    monkeypatch.setattr(fit_check, "free_device_memory", lambda device: (whole + tiled) // 2)
    monkeypatch.setattr(fit_check, "available_ram", lambda: 64 * 2**30)
    said = []
    resolved, plan = resolve_planned_autos(flux_config(), fake_device, SimpleNamespace(main=True, world=1), said.append)
    assert resolved.sampling.vae_tiling is True and plan["auto"]["sampling.vae_tiling"]["value"] is True
    assert any(line.startswith("sampling.vae_tiling: auto -> true (the untiled decode sets the peak") for line in said)
