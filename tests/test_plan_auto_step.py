"""`gradient_checkpointing: auto` and `schedule.batch_size: auto` (issue 25 item 2), resolved through
the plan to the fastest step that fits (modules/plan/auto.py): checkpointing stays off while some
batch fits without it, the batch is the largest of (1, 2, 4, 8) that fits. The budgets here are cut
between the tiny SD1.5's own planned peaks, so each case has one right answer; the run resolves the
same way on the fake device with that capacity, says so in its log, and trains without running out
of memory at the batch it picked."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import train_config

AUTO = {"model": {"parts": {"unet": {"gradient_checkpointing": "auto"}}}, "schedule": {"batch_size": "auto"}}


def fixed(checkpointing: bool, batch: int) -> dict:
    return {"model": {"parts": {"unet": {"gradient_checkpointing": checkpointing}}}, "schedule": {"batch_size": batch}}


@pytest.fixture(scope="module")
def planner(tiny_model):
    """One planner for the module: its fake steps (one per checkpointing, batch and device) are
    kept, so the auto plans below reuse those the peaks measured."""
    from modules.plan.run_plan import Planner

    return Planner(None)


@pytest.fixture(scope="module")
def peaks(planner, tiny_model, shape_images, tmp_path_factory):
    """(train device, checkpointing, batch) -> the planned device peak of that fixed step."""
    from modules.plan.run_plan import plan_run

    folder = tmp_path_factory.mktemp("auto-step")

    def peak(device: str, checkpointing: bool, batch: int) -> int:
        config = train_config(tiny_model, shape_images, folder, fixed(checkpointing, batch), {"train_device": device})
        return plan_run(config, None, None, planner=planner).device_peak

    return peak


@pytest.fixture
def auto_plan(planner, tiny_model, shape_images, tmp_path):
    from modules.plan.run_plan import plan_run

    def plan(vram, *overlays):
        done = plan_run(train_config(tiny_model, shape_images, tmp_path, AUTO, *overlays), vram, None, planner=planner)
        return done, {path: choice["value"] for path, choice in done.auto.items()}, done.auto

    return plan


def test_the_largest_batch_that_fits_without_checkpointing(peaks, auto_plan):
    off = {batch: peaks("cpu", False, batch) for batch in (2, 4)}
    assert off[2] < off[4]
    plan, picked, _ = auto_plan((off[2] + off[4]) // 2)
    assert picked == {"model.parts.unet.gradient_checkpointing": False, "schedule.batch_size": 2}
    assert plan.fits and plan.device_peak == off[2]
    _, roomy, why = auto_plan(100 * peaks("cpu", False, 8))
    assert roomy == {"model.parts.unet.gradient_checkpointing": False, "schedule.batch_size": 8}
    assert why["schedule.batch_size"]["why"] == "the largest of 1, 2, 4, 8 that fits the budget"


def test_checkpointing_comes_on_only_where_no_batch_fits_without_it(peaks, auto_plan):
    off_one, on_one = peaks("cpu", False, 1), peaks("cpu", True, 1)
    assert on_one < off_one  # what checkpointing is for
    plan, picked, why = auto_plan((on_one + off_one) // 2)
    assert picked["model.parts.unet.gradient_checkpointing"] is True
    assert why["model.parts.unet.gradient_checkpointing"]["why"] == "without it the step does not fit the budget"
    batch = picked["schedule.batch_size"]
    assert plan.fits and plan.device_peak == peaks("cpu", True, batch)
    assert batch == 8 or peaks("cpu", True, 2 * batch) > (on_one + off_one) // 2  # the largest that fits


def test_nothing_fits_gives_the_smallest_step_and_the_fixes(peaks, auto_plan):
    plan, picked, why = auto_plan(peaks("cpu", True, 1) // 2)
    assert picked == {"model.parts.unet.gradient_checkpointing": True, "schedule.batch_size": 1}
    assert why["schedule.batch_size"]["why"] == "nothing fits the budget"
    assert plan.fits is False


def test_no_budget_means_no_checkpointing_and_batch_one(auto_plan):
    _, picked, why = auto_plan(None)
    assert picked == {"model.parts.unet.gradient_checkpointing": False, "schedule.batch_size": 1}
    assert why["schedule.batch_size"]["why"] == "no train-device budget known here (the CPU)"


def test_what_must_checkpoint_does_and_a_part_outside_the_step_does_not(auto_plan):
    overlay = {"model": {"parts": {"unet": {"activation_offloading": True},
                                   "text_encoder": {"gradient_checkpointing": "auto"}}}}
    _, picked, why = auto_plan(None, overlay)  # (no plan is asked: neither needs one)
    assert picked["model.parts.unet.gradient_checkpointing"] is True
    assert why["model.parts.unet.gradient_checkpointing"]["why"].startswith("activation offloading keeps")
    assert picked["model.parts.text_encoder.gradient_checkpointing"] is False
    assert why["model.parts.text_encoder.gradient_checkpointing"]["why"] == "not in the training step"


def train_within(config, budget: int):
    """(the run's status lines, the trainer) of `config` trained on the fake device with `budget`
    bytes free; past the capacity the fake device raises torch.OutOfMemoryError, as CUDA does."""
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer

    said = []
    callbacks = TrainCallbacks()
    callbacks.on_status = said.append
    torch.fakegpu.set_memory_capacity(torch.fakegpu.memory_allocated() + budget)
    try:
        trainer = GenericTrainer(config, callbacks)
        trainer.start()
        trainer.train()  # past the capacity this raises torch.OutOfMemoryError
        trainer.end()
    finally:
        torch.fakegpu.set_memory_capacity(None)
    return said, trainer


def test_a_run_on_the_fake_device_takes_the_plans_choice_and_fits(fake_device, peaks, tiny_model, shape_images,
                                                                   tmp_path):
    budget = (peaks("fakegpu", False, 2) + peaks("fakegpu", False, 4)) // 2
    config = train_config(tiny_model, shape_images, tmp_path, AUTO, {"train_device": "fakegpu",
                                                                     "schedule": {"max_steps": 2}})
    said, trainer = train_within(config, budget)
    assert "schedule.batch_size: auto -> 2 (the largest of 1, 2, 4, 8 that fits the budget)" in said
    assert "model.parts.unet.gradient_checkpointing: auto -> false (the step fits without recomputing)" in said
    written = json.loads((tmp_path / "ws" / "config.json").read_text())
    assert written["schedule"]["batch_size"] == 2
    assert written["model"]["parts"]["unet"]["gradient_checkpointing"] is False
    assert trainer.dataset.batch_size == 2


def test_a_cpu_run_says_it_had_no_budget(tiny_model, shape_images, tmp_path):
    from modules.trainer.planned_autos import resolve_planned_autos
    from modules.trainer.distributed import Ranks

    said = []
    config = train_config(tiny_model, shape_images, tmp_path, AUTO)
    resolved, plan = resolve_planned_autos(config, torch.device("cpu"), Ranks(0, 1, 0), said.append)
    assert plan is None and resolved.schedule.batch_size == 1
    assert resolved.model.parts["unet"].gradient_checkpointing is False
    assert said == ["model.parts.unet.gradient_checkpointing: auto -> false (no train-device budget known here "
                    "(the CPU))", "schedule.batch_size: auto -> 1 (no train-device budget known here (the CPU))"]


def test_a_batch_size_that_is_neither_a_count_nor_auto_is_one_message():
    from modules.config.loading import build_config

    with pytest.raises(ValueError, match=r"schedule.batch_size: must be a whole number from 1 to 1024, or 'auto' "
                                         r"\(got 'lots'\)"):
        build_config([{"schedule": {"batch_size": "lots"}}])
    assert build_config([{"schedule": {"batch_size": "auto"}}]).schedule.batch_size == "auto"


def test_a_config_the_plan_cannot_read_is_left_to_preflight(fake_device, tiny_model, shape_images, tmp_path):
    from modules.errors import UserError
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_model, shape_images, tmp_path, AUTO, {"train_device": "fakegpu",
                                                                     "model": {"base": str(tmp_path / "nowhere")}})
    said = []
    callbacks = TrainCallbacks()
    callbacks.on_status = said.append
    with pytest.raises(UserError) as caught:
        GenericTrainer(config, callbacks).start()
    assert str(caught.value).startswith("model.base: ")  # preflight's own message, not the planner's
    assert any(line.startswith("schedule.batch_size: auto -> 1 (the plan could not be made (") for line in said), said


# --- offload_fraction: auto against the whole step ---------------------------------------------------

PARK = {"model": {"parts": {"unet": {"offload_fraction": "auto", "gradient_checkpointing": True}}}}


def parking_budget(unparked) -> int:
    """A budget the step fits only with part of the U-Net's blocks parked (a third of its weights
    less, and the offload window's blocks besides)."""
    return unparked.device_peak - unparked.parts["unet"].device["weights"] // 3


def test_auto_offload_parks_for_the_steps_activations_not_only_for_the_weights(planner, tiny_model, shape_images,
                                                                               tmp_path):
    from modules.plan.auto import offload_fractions
    from modules.plan.run_plan import plan_run

    config = train_config(tiny_model, shape_images, tmp_path, PARK)
    unparked = plan_run(config, None, None, planner=planner)
    weights = sum(part.device["weights"] for part in unparked.parts.values())
    budget = parking_budget(unparked)
    assert weights < budget / 2  # the weights fit many times over; the step does not
    sizes = planner.sizes(config, planner.weight_modes(config))["parts"]
    assert offload_fractions(config, sizes, {"unet": "adapter"}, 0.0, budget)["unet"] == 0.0  # weights alone
    plan = plan_run(config, budget, None, planner=planner)
    fraction = plan.auto["model.parts.unet.offload_fraction"]
    assert 0 < fraction["value"] < 1 and plan.fits and plan.device_peak <= budget
    assert fraction["why"] == "the smallest share of the blocks that fits the budget, the step's activations included"
    less = fraction["value"] - 0.05  # the smallest: a step less parked does not fit
    config_less = train_config(tiny_model, shape_images, tmp_path, PARK,
                               {"model": {"parts": {"unet": {"offload_fraction": less}}}})
    assert plan_run(config_less, budget, None, planner=planner, fix=False).device_peak > budget
    roomy = plan_run(config, unparked.device_peak, None, planner=planner).auto["model.parts.unet.offload_fraction"]
    assert roomy == {"value": 0.0, "why": "everything fits without parking"}


def test_a_run_on_the_fake_device_parks_what_the_plan_says_and_fits(fake_device, planner, tiny_model, shape_images,
                                                                    tmp_path):
    from modules.plan.run_plan import plan_run

    config = train_config(tiny_model, shape_images, tmp_path, PARK, {"train_device": "fakegpu",
                                                                     "schedule": {"max_steps": 2}})
    budget = parking_budget(plan_run(config, None, None, planner=planner))
    said, trainer = train_within(config, budget)
    line = next(s for s in said if s.startswith("model.parts.unet.offload_fraction: auto -> "))
    value = float(line.split(" -> ")[1].split(" ")[0])
    assert 0 < value < 1 and line.endswith("(the smallest share of the blocks that fits the budget, the step's "
                                           "activations included)"), said
    written = json.loads((tmp_path / "ws" / "config.json").read_text())
    assert written["model"]["parts"]["unet"]["offload_fraction"] == value


BOTH_AUTO = {"model": {"parts": {"unet": {"offload_fraction": "auto", "gradient_checkpointing": "auto"}}}}


def test_a_trained_part_with_parking_and_checkpointing_auto_recomputes_only_where_it_parks(
        planner, tiny_model, shape_images, tmp_path):
    """Parking a trained part forces checkpointing; but with both auto, a step that fits unparked
    needs neither (the plan used to force checkpointing on for `offload_fraction: auto` itself)."""
    from modules.plan.run_plan import plan_run

    config = train_config(tiny_model, shape_images, tmp_path, BOTH_AUTO)
    unparked = plan_run(config, None, None, planner=planner)
    assert unparked.auto["model.parts.unet.gradient_checkpointing"]["value"] is False
    roomy = plan_run(config, 2 * unparked.device_peak, None, planner=planner)
    assert {path: choice["value"] for path, choice in roomy.auto.items()} == {
        "model.parts.unet.gradient_checkpointing": False, "model.parts.unet.offload_fraction": 0.0}
    assert roomy.fits and roomy.parts["unet"].offload_fraction == 0.0
    tight = plan_run(config, parking_budget(plan_run(train_config(tiny_model, shape_images, tmp_path, PARK), None,
                                                     None, planner=planner)), None, planner=planner)
    assert tight.auto["model.parts.unet.gradient_checkpointing"]["value"] is True
    assert tight.auto["model.parts.unet.offload_fraction"]["value"] > 0 and tight.fits


def test_a_cpu_run_with_parking_and_checkpointing_auto_parks_nothing_and_does_not_recompute(
        tiny_model, shape_images, tmp_path):
    from modules.trainer.distributed import Ranks
    from modules.trainer.planned_autos import resolve_planned_autos

    config = train_config(tiny_model, shape_images, tmp_path, BOTH_AUTO)
    resolved, _ = resolve_planned_autos(config, torch.device("cpu"), Ranks(0, 1, 0), lambda line: None)
    assert resolved.model.parts["unet"].gradient_checkpointing is False
    assert resolved.model.parts["unet"].offload_fraction == 0.0


def test_a_run_on_the_fake_device_stores_auto_weights_as_the_plan_says(fake_device, planner, tiny_model, shape_images,
                                                                       tmp_path):
    """`weight_dtype: auto` in a run goes through the plan too (activations included, modes that work
    on the device): at a budget the dense step misses by a byte and 8-bit fits, the run loads the
    U-Net in 8 bits (the precision policy counted weights alone: dense). (Loaded, not trained: the fake
    device has no autocast, and the plan must compute in bfloat16 for 8-bit storage to be smaller.)"""
    from modules.plan.run_plan import plan_run
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer
    from modules.trainer.planned_autos import device_weight_ladder

    auto = {"model": {"parts": {"unet": {"weight_dtype": "auto"}}}, "train_dtype": "bfloat16",
            "train_device": "fakegpu"}
    config = train_config(tiny_model, shape_images, tmp_path, auto)
    ladder = device_weight_ladder(torch.device("fakegpu"))
    dense = plan_run(config, None, None, planner=planner, weight_ladder=ladder).device_peak
    eight_bit = train_config(tiny_model, shape_images, tmp_path, auto,
                             {"model": {"parts": {"unet": {"weight_dtype": ladder[1]}}}})
    assert plan_run(eight_bit, None, None, planner=planner).device_peak < dense - 1
    said = []
    callbacks = TrainCallbacks()
    callbacks.on_status = said.append
    torch.fakegpu.set_memory_capacity(torch.fakegpu.memory_allocated() + dense - 1)
    try:
        trainer = GenericTrainer(config, callbacks)
        trainer.start()
    finally:
        torch.fakegpu.set_memory_capacity(None)
    assert any(line.startswith(f"model.parts.unet.weight_dtype: auto -> {ladder[1]} (the densest storage that fits")
               for line in said), said
    assert trainer.family.weight_modes["unet"] == ladder[1]
    written = json.loads((tmp_path / "ws" / "config.json").read_text())
    assert written["model"]["parts"]["unet"]["weight_dtype"] == ladder[1]
