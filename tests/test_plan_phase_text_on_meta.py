"""The caching and sampling phases encode text on meta tensors, transformers' mask helpers taking the
branch they take for fake tensors (modules/plan/traced_meta.py), as the step does: the same plan to
the byte as the pass on fake tensors, which without that branch they fall back to (a mask's
`.all()` read on meta), at about a sixteenth of the time (Qwen2.5-VL at Qwen-Image-Edit's size:
0.09 s against 1.5 s). Tiny Qwen-Image-Edit (Qwen2.5-VL) and Anima (Qwen3)."""

from __future__ import annotations

import contextlib

import pytest
from conftest import train_config
from torch._subclasses.fake_tensor import FakeTensorMode

RUN = {"data": {"resolution": 64}, "schedule": {"epochs": 1, "batch_size": 1, "max_steps": 1},
       "sampling": {"prompts": [{"prompt": "a red circle", "steps": 2, "width": 64, "height": 64}]}}


@pytest.mark.parametrize("family", ["qwen_image_edit", "anima"])
def test_the_phases_text_pass_runs_on_meta_and_plans_what_fake_tensors_plan(family, fake_device, tmp_path,
                                                                             tiny_family_model, shape_images,
                                                                             monkeypatch):
    from modules.plan import phase_pass, traced_meta
    from modules.plan.run_plan import plan_run

    entered = []

    class Watched(FakeTensorMode):
        def __enter__(self):
            entered.append(True)
            return super().__enter__()

    monkeypatch.setattr(phase_pass, "FakeTensorMode", Watched)
    config = train_config(tiny_family_model(family), shape_images, tmp_path, RUN,
                          {"model": {"family": family}, "train_device": str(fake_device)})
    on_meta = plan_run(config, None, None).as_dict()
    assert not entered, "a phase's text pass fell back to fake tensors"
    monkeypatch.setattr(traced_meta, "meta_tensors_traced", contextlib.nullcontext)  # the mask reads fail on meta
    on_fake = plan_run(config, None, None).as_dict()
    assert entered, "without the traced branch the text pass should have run on fake tensors"
    assert on_meta == on_fake
