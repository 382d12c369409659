"""The plan of an edit model counts its control (reference) images (modules/plan/controls.py): their
latents join the denoiser's sequence after the target's, and Qwen-Image-Edit's VL text encoder adds
their image tokens to the conditioning. On each edit family's tiny model the planned device peak grows
with each control, and for FLUX.1 Kontext, Qwen-Image-Edit and FIBO-2 (its image to edit) it stays
within 10% of the peak a real run reaches on the fake device (as tests/test_plan_accuracy.py measures
it; planned/measured 1.018, 0.983, 1.014); a plan that leaves the controls out is 0.4x (Kontext),
0.8x (Qwen-Image-Edit) and 0.4x (FIBO-2) of that peak there. The whole run's peak too (loading and
caching included), planned/measured 1.018, 1.010 (Qwen-Image-Edit's is its caching phase), 1.014."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from benchmarks.plan_accuracy import measured_device_peak
from conftest import train_config
from modules.config.families import get_family_class
from modules.config.loading import build_config
from modules.data.synthetic_images import write_edit_pairs
from modules.plan.controls import planned_controls
from modules.plan.run_plan import Planner, plan_run


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Edit pairs with one control per target, and the same with a second (control_2/)."""
    one = tmp_path_factory.mktemp("pairs-1")
    write_edit_pairs(one, count=2)
    two = tmp_path_factory.mktemp("pairs-2")
    shutil.copytree(one, two, dirs_exist_ok=True)
    shutil.copytree(one / "control", two / "control_2")
    return {1: one, 2: two}


def _concepts(pairs, shape_images, controls: int) -> list[dict]:
    if controls == 0:
        return [{"path": str(shape_images)}]
    return [{"path": str(pairs[controls]), "controls": {"source": "folders"}}]


def _config(model, family, concepts, tmp_path, **overlay):
    return train_config(model, concepts[0]["path"], tmp_path, {"model": {"family": family}, "concepts": concepts},
                        overlay)


def _planned(model, family, pairs, shape_images, tmp_path, counts, **overlay):
    """The plans of the same run with each count of controls per sample (one planner: its sizes read once)."""
    configs = [_config(model, family, _concepts(pairs, shape_images, n), tmp_path, **overlay) for n in counts]
    planner = Planner(configs[0])
    plans = [plan_run(config, None, None, planner=planner) for config in configs]
    for count, plan in zip(counts, plans):
        assert any(f"with {count} control image(s)" in note for note in plan.notes) == (count > 0), plan.notes
    peaks, flops = [p.step_peak for p in plans], [p.flops for p in plans]
    assert peaks == sorted(set(peaks)) and flops == sorted(set(flops)), (counts, peaks, flops)
    return plans


@pytest.mark.parametrize("family", ["qwen_image_edit_plus", "flux2", "fibo_edit"])
def test_the_planned_peak_grows_with_each_control(family, tiny_family_model, pairs, shape_images, tmp_path):
    _planned(tiny_family_model(family), family, pairs, shape_images, tmp_path, (0, 1, 2))


def test_fibo2s_planned_peak_grows_with_the_image_to_edit(tiny_family_model, pairs, shape_images, tmp_path):
    _planned(tiny_family_model("fibo2"), "fibo2", pairs, shape_images, tmp_path, (0, 1))  # it edits one image


@pytest.mark.parametrize("family", ["flux_kontext", "qwen_image_edit", "fibo2"])
def test_the_planned_peak_grows_with_a_control_to_within_ten_percent_of_the_measured_one(
        family, tiny_family_model, pairs, shape_images, fake_device, tmp_path):
    run = {"train_device": str(fake_device), "schedule": {"epochs": 2, "batch_size": 2, "max_steps": 2}}
    model = tiny_family_model(family)
    plan = _planned(model, family, pairs, shape_images, tmp_path, (0, 1), **run)[1]
    config = _config(model, family, _concepts(pairs, shape_images, 1), tmp_path, **run)
    measured = measured_device_peak(config)
    assert measured.steps == 2
    print(family, "planned/measured step", round(plan.step_peak / measured.training_peak, 3),
          "whole run", round(plan.device_peak / measured.peak, 3))
    assert plan.step_peak == pytest.approx(measured.training_peak, rel=0.10), \
        f"step: planned {plan.step_peak} bytes, measured {measured.training_peak}"
    # the whole run too: Qwen-Image-Edit's is its caching phase's (the VAE over the chunk), which the
    # trainer's reset of the device's peaks as training starts once hid from this measure
    assert plan.device_peak == pytest.approx(measured.peak, rel=0.10), \
        f"whole run: planned {plan.device_peak} bytes ({plan.outside_step_phases}), measured {measured.peak}"


@pytest.mark.parametrize(("family", "controls"), [("qwen_image_edit", 1), ("qwen_image_edit_plus", 2)])
def test_planned_conditioning_with_controls_is_what_encode_text_gives(family, controls, tiny_family_model, pairs):
    from PIL import Image

    family_class = get_family_class(family)
    loaded = family_class(build_config([{"model": {"family": family, "base": str(tiny_family_model(family))}}]))
    loaded.load()
    images = [Image.new("RGB", (64, 48)) for _ in range(controls)]
    with torch.no_grad():
        encoded = loaded.encode_text(loaded.tokenize(["a red square", "a blue circle"], [images, images]))
    planned = loaded.planning_conditioning_with_controls(2, torch.device("cpu"), controls, 64, 48)
    assert {k: (tuple(v.shape), v.dtype) for k, v in planned.items()} == \
        {k: (tuple(v.shape), v.dtype) for k, v in encoded.items()}
    # planning a folder without its tokenizer: the markers and pads, "Picture N:" by its characters (the
    # tiny tokenizer's count too: a token per character)
    counted = loaded.image_block_tokens(controls, 64, 48)
    del loaded.tokenizer
    assert loaded.image_block_tokens(controls, 64, 48) == counted


def test_the_count_comes_from_the_concepts_else_the_familys_usual_one(pairs, tmp_path):
    kontext, flux2 = get_family_class("flux_kontext"), get_family_class("flux2")
    preset = build_config([{"model": {"family": "flux_kontext"}}])
    assert planned_controls(preset, kontext).count == 1  # a preset: no concept to count from
    assert planned_controls(build_config([{"model": {"family": "flux2"}}]), flux2).count == 0
    manifest = tmp_path / "pairs.jsonl"
    manifest.write_text("\n".join(json.dumps({"target": "t.png", "control": c}) for c in
                                  ["a.png", ["a.png", "b.png", "c.png"], ["a.png"]]) + "\n")

    def counted(family, *concepts):
        config = build_config([{"model": {"family": family}, "concepts": list(concepts)}])
        return planned_controls(config, get_family_class(family))

    assert counted("flux2", {"path": str(tmp_path)}).count == 0  # plain images: none
    assert counted("flux2", {"path": str(pairs[2]), "controls": {"source": "folders"}}).count == 2
    found = counted("flux2", {"path": str(tmp_path / "absent")}, {"path": str(tmp_path), "controls": {"source": "manifest"}})
    assert (found.count, found.source) == (3, "concepts[1].controls")
    # a folder not there yet: the most the family takes
    assert counted("fibo_edit", {"path": str(tmp_path / "absent"), "controls": {"source": "folders"}}).count == 4
