"""One planner's plans of a config with the sample decode tiled and whole (`sampling.vae_tiling:
auto`, resolved last) share the passes tiling does not change (phase_pass.PhasePasses): the caching
phase, the prompt's text encoding and, where the VAE does not run in it, the denoiser's pass. Each
plan must equal a fresh planner's: tiny FLUX.1 (the VAE only decodes) and Wan 2.1 I2V (the
pipeline's own VAE encodes the prompt's image inside the denoising, tiled where the decode is), at
samples large enough to tile."""

from __future__ import annotations

import functools

import pytest
from conftest import train_config
from diffusers import AutoencoderKLWan

RUN = {"data": {"resolution": 64}, "schedule": {"epochs": 1, "batch_size": 1, "max_steps": 1}}
SAMPLES = {"flux": {"width": 128, "height": 128}, "wan_i2v": {"width": 128, "height": 128, "frames": 5}}


@pytest.fixture
def config_of(fake_device, tmp_path, tiny_family_model, shape_images, monkeypatch):
    from modules.sampling import vae_tiling

    monkeypatch.setattr(vae_tiling, "KL_TILE_PIXELS", 32)  # FLUX.1's VAE; Wan's in 64 px tiles (its own: 256 px)
    wan_vae = AutoencoderKLWan.enable_tiling
    monkeypatch.setattr(AutoencoderKLWan, "enable_tiling", functools.partialmethod(
        wan_vae, tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=48,
        tile_sample_stride_width=48))

    def make(family, tiling):
        prompt = {"prompt": "a red circle", "steps": 2, **SAMPLES[family]}
        return train_config(tiny_family_model(family), shape_images, tmp_path, RUN, {
            "model": {"family": family}, "train_device": str(fake_device),
            "sampling": {"vae_tiling": tiling, "prompts": [prompt]}})
    return make


@pytest.mark.parametrize("family", list(SAMPLES))
def test_tiled_and_whole_plans_of_one_planner_are_a_fresh_planners(family, config_of, monkeypatch):
    from modules.plan import phase_pass
    from modules.plan.run_plan import Planner, plan_run

    passes = []
    peak = phase_pass._peak
    monkeypatch.setattr(phase_pass, "_peak", lambda run, *args: passes.append(run.__name__) or peak(run, *args))
    planner = Planner(config_of(family, "auto"))
    shared = {tiled: plan_run(config_of(family, tiled), None, None, planner=planner).as_dict() for tiled in (False, True)}
    # the caching phase and, where the VAE does not run in it (FLUX.1), the denoiser's pass once for both
    assert passes.count("encode") == 1 and passes.count("denoise") == (2 if family == "wan_i2v" else 1), passes
    fresh = {tiled: plan_run(config_of(family, tiled), None, None).as_dict() for tiled in (False, True)}
    assert shared == fresh
    assert fresh[True]["device"]["outside_step_phases"] != fresh[False]["device"]["outside_step_phases"]  # they tile


@pytest.mark.parametrize("family", list(SAMPLES))
def test_auto_tiling_reruns_only_what_tiling_changes(family, config_of, monkeypatch):
    """`vae_tiling: auto` against a budget the untiled sample decode overruns and the tiled one fits:
    the resolver plans both tilings, yet caching runs once, the decode once per tiling and the
    denoiser's pass once (twice where the VAE runs in it, Wan 2.1 I2V): no second full set of passes."""
    from modules.plan import phase_pass
    from modules.plan.run_plan import plan_run

    if family == "wan_i2v":  # a sample large enough that its decode, not the step, sets the peak
        monkeypatch.setitem(SAMPLES, family, {"width": 256, "height": 256, "frames": 5})
    whole, tiled = (plan_run(config_of(family, t), None, None).device_peak for t in (False, True))
    assert tiled < whole
    passes = []
    peak = phase_pass._peak
    monkeypatch.setattr(phase_pass, "_peak", lambda run, *args: passes.append(run.__name__) or peak(run, *args))
    plan = plan_run(config_of(family, "auto"), (whole + tiled) // 2, None, fix=False)
    assert plan.auto["sampling.vae_tiling"]["value"] is True, plan.auto
    assert passes.count("encode") == 1 and passes.count("decode") == 2, passes
    assert passes.count("denoise") == (2 if family == "wan_i2v" else 1), passes
