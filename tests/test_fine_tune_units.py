"""The pieces of the full fine-tune without a training run: stochastic rounding is unbiased; the
fused backward ends at the same weights as the ordinary step; bfloat16 weights step through
float32 with any per-parameter optimizer; what a fine-tune refuses is refused when the config is
validated, naming the field; the original-layout writer round-trips SDXL through the trainer's
own single-file loader; the disk estimate sizes full weights; EMA on the CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config
from torch import nn

from modules.config.errors import ConfigError
from modules.config.methods.adapter import AdapterMethodConfig
from modules.optim.fused_backward import FusedBackward
from modules.optim.optimizers import build_optimizer
from modules.optim.rounded_step import step_bfloat16_stochastically
from modules.optim.single_parameter_step import SingleParameterStepper
from modules.optim.stochastic_rounding import stochastic_round_to_bfloat16

# --- stochastic rounding -----------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased_where_nearest_rounding_loses_the_value():
    torch.manual_seed(0)
    for value in (1.0 + 2 ** -10, -3.0 - 2 ** -8, 0.1):
        values = torch.full((200_000,), value, dtype=torch.float32)
        rounded = stochastic_round_to_bfloat16(values)
        assert rounded.dtype == torch.bfloat16
        low, high = sorted({float(v) for v in rounded.unique()})  # only the two neighbours occur
        assert low <= value <= high
        assert abs(rounded.double().mean().item() - value) < (high - low) * 0.01
    nearest = torch.tensor(1.0 + 2 ** -10).to(torch.bfloat16)
    assert float(nearest) == 1.0  # what plain rounding makes of it: the update is lost
    special = torch.tensor([float("inf"), -float("inf"), 2.0, float("nan")]).repeat(1000)
    special[3::4] = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)  # a NaN whose bits carry
    rounded = stochastic_round_to_bfloat16(special)
    assert torch.equal(rounded[:3], torch.tensor([float("inf"), -float("inf"), 2.0], dtype=torch.bfloat16))
    assert rounded[3::4].isnan().all() and not special[3::4].isinf().any()  # the input is left as it was


def test_autocast_keeps_no_low_precision_copy_of_the_trained_weights():
    """Its cache would hold a bfloat16 copy of every float32 trained weight through the forward."""
    from modules.util.torch_utils import autocast

    with autocast(torch.device("cpu"), torch.bfloat16):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()


# --- stepping one parameter at a time ----------------------------------------------------------


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 16)).to(dtype)  # 4608 weights: 8-bit state


def _batches(count=3):
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(5, 3, 6, 6, generator=generator), torch.randn(5, 16, generator=generator))
            for _ in range(count)]


def _optimizer(kind: str, model: nn.Module):
    from modules.config.loading import build_config

    config = build_config([{"optimizer": {"type": kind, "lr": 1e-2}}]).optimizer
    half = len(list(model.parameters())) // 2
    params = list(model.parameters())
    return build_optimizer(config, [{"params": params[:half], "lr": 1e-2, "name": "a"},
                                    {"params": params[half:], "lr": 3e-3, "name": "b"}])


def _loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


@pytest.mark.parametrize("kind", ["adamw", "adamw_8bit", "adafactor", "lion", "came"])
def test_fused_backward_ends_at_the_weights_of_the_ordinary_step(kind):
    plain, fused = _model(), _model()
    plain_optimizer, fused_optimizer = _optimizer(kind, plain), _optimizer(kind, fused)
    hooks = FusedBackward(list(fused.named_parameters()), max_grad_norm=None)
    hooks.attach(SingleParameterStepper(fused_optimizer, stochastic_rounding=False))
    for batch in _batches():
        _loss(plain, batch).backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad(set_to_none=True)
        _loss(fused, batch).backward()  # each parameter stepped, and its gradient freed, in here
        assert all(p.grad is None for p in fused.parameters())
    assert hooks.take_gradients_seen() == {name: True for name, _ in fused.named_parameters()}
    for (name, a), b in zip(plain.named_parameters(), fused.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
    assert not torch.equal(plain[0].weight, _model()[0].weight)  # it trained


def test_fused_backward_clips_each_parameter_on_its_own():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    hooks = FusedBackward(list(model.named_parameters()), max_grad_norm=1e-3)
    hooks.attach(SingleParameterStepper(optimizer, stochastic_rounding=False))
    (_loss(model, _batches(1)[0]) * 1000).backward()
    for old, new in zip(before, model.parameters()):  # SGD at lr 1: the step is the clipped gradient
        assert torch.linalg.vector_norm(old - new).item() == pytest.approx(1e-3, rel=1e-3)


def test_bfloat16_weights_step_through_float32_with_stochastic_rounding():
    reference, model = _model(), _model(torch.bfloat16)
    reference_optimizer, optimizer = _optimizer("adamw", reference), _optimizer("adamw", model)
    step_bfloat16_stochastically(SingleParameterStepper(optimizer, stochastic_rounding=True))
    torch.manual_seed(3)
    for batch in _batches():
        for m, o in ((reference, reference_optimizer), (model, optimizer)):
            _loss(m, batch).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    state = optimizer.state[model[0].weight]
    assert model[0].weight.dtype == torch.bfloat16 and state["exp_avg"].dtype == torch.float32
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.allclose(a, b.float(), atol=2e-2)
    assert all(len(g["params"]) for g in optimizer.param_groups)  # the hidden weights are shown again


# --- refused when the config is validated ------------------------------------------------------


def _config(tmp_path, *overlays):
    return train_config(tmp_path / "model", tmp_path / "images", tmp_path, {"method": {"type": "fine_tune"}},
                        *overlays)


@pytest.mark.parametrize("mode", ["float8", "int8", "w8a8_int8", "w8a8_fp8", "nf4", "auto", "float16"])
def test_a_quantized_or_auto_trained_part_is_refused_naming_its_weight_dtype(tmp_path, mode):
    with pytest.raises(ConfigError, match=r"model\.parts\.unet\.weight_dtype: .*float32 or bfloat16"):
        _config(tmp_path, {"model": {"parts": {"unet": {"weight_dtype": mode}}}})
    # a frozen part may stay quantized (its original weights are copied from the base folder into a
    # diffusers folder; a single file cannot take them from a folder), and an adapter may train on a
    # quantized base
    _config(tmp_path, {"model": {"parts": {"text_encoder": {"weight_dtype": mode}}},
                       "method": {"save_format": "diffusers"}})
    if mode not in ("auto", "float16"):
        with pytest.raises(ConfigError, match=r"model\.parts\.text_encoder\.weight_dtype: .*method\.save_format"):
            _config(tmp_path, {"model": {"parts": {"text_encoder": {"weight_dtype": mode}}}})
    train_config(tmp_path, tmp_path, tmp_path, {"model": {"parts": {"unet": {"weight_dtype": mode}}}})


@pytest.mark.parametrize("overlay, field", [
    ({"schedule": {"gradient_accumulation": 2}}, r"schedule\.gradient_accumulation: method\.fused_backward"),
    ({"train_dtype": "float16"}, r"train_dtype: float16 training"),
    ({"optimizer": {"type": "prodigy"}}, r"optimizer\.type: Prodigy"),
    ({"optimizer": {"type": "schedule_free_adamw"}, "method": {"fused_backward": False},
      "model": {"parts": {"unet": {"weight_dtype": "bfloat16"}}}}, r"optimizer\.type: schedule-free"),
    ({"model": {"parts": {"unet": {"offload_fraction": 0.5, "gradient_checkpointing": True}}},
      "method": {"fused_backward": False}}, r"model\.parts\.unet\.offload_fraction: .*method\.fused_backward"),
    ({"model": {"family": "flux"}, "method": {"save_format": "single_file"}}, r"method\.save_format: .*sd15, sdxl"),
])
def test_what_a_fine_tune_cannot_combine_is_refused_naming_the_field(tmp_path, overlay, field):
    with pytest.raises(ConfigError, match=field):
        _config(tmp_path, overlay)


def test_without_the_fused_step_those_combinations_are_accepted(tmp_path):
    _config(tmp_path, {"method": {"fused_backward": False}, "schedule": {"gradient_accumulation": 2},
                       "optimizer": {"type": "prodigy"}, "train_dtype": "float16"})
    _config(tmp_path, {"model": {"family": "flux"}})  # save_format auto: a diffusers folder there
    # layer offloading of a trained part works with the fused step (tests/test_fine_tune_offload.py)
    _config(tmp_path, {"model": {"parts": {"unet": {"offload_fraction": 0.5, "gradient_checkpointing": True}}}})


# --- the original layout, both ways ------------------------------------------------------------


def test_sdxl_written_in_the_original_layout_loads_back_to_the_same_tensors(tmp_path, tiny_family_model,
                                                                           shape_images):
    from safetensors.torch import save_file

    from modules.model.sdxl import SDXLFamily
    from modules.saving.ldm_checkpoint import part_to_ldm

    folder = tiny_family_model("sdxl")
    config = train_config(folder, shape_images, tmp_path / "a", {"model": {"family": "sdxl"}})
    ours = SDXLFamily(config)
    ours.load()
    tensors = {}
    for spec in ours.part_specs:
        module = ours.parts[spec.name]
        tensors.update(part_to_ldm(module, module.state_dict(), ours.single_file_part(spec.name).prefixes[0]))
    file = tmp_path / "sdxl.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file))
    back = SDXLFamily(train_config(file, shape_images, tmp_path / "b", {"model": {"family": "sdxl"}}))
    back.model_configs_dir = folder
    back.load()
    for part, module in ours.parts.items():
        expected, loaded = module.state_dict(), back.parts[part].state_dict()
        assert expected.keys() == loaded.keys(), part
        for key in expected:
            assert torch.equal(expected[key], loaded[key]), (part, key)

    # SDXL reads CLIP-L's penultimate layer: its last layer and final norm never reach the loss, so a
    # fine-tune leaves them out; CLIP-G's pooled projection reads all of it
    from modules.methods.reachable_weights import reachable_text_weights

    for part, unreachable in (("text_encoder", {"final_layer_norm.weight", "encoder.layers.1.mlp.fc2.bias"}),
                              ("text_encoder_2", set())):
        reachable = reachable_text_weights(ours, part)
        left_out = {n.removeprefix("text_model.") for n, p in ours.parts[part].named_parameters()
                    if id(p) not in reachable}
        assert unreachable <= left_out and not any(".layers.0." in n or "embeddings" in n for n in left_out), part
        assert bool(left_out) == bool(unreachable), (part, left_out)


# --- sizes and EMA -----------------------------------------------------------------------------


def test_the_disk_estimate_of_a_fine_tune_counts_full_weights(tmp_path, tiny_model, shape_images):
    from modules.methods.base import method_class
    from modules.model.sd15 import SD15Family
    from modules.trainer.backup_size import planned_bytes

    config = train_config(tiny_model, shape_images, tmp_path, {"method": {"type": "fine_tune"}},
                          {"model": {"parts": {"unet": {"weight_dtype": "bfloat16"}}}})
    family = SD15Family(config)
    counts = family.part_parameters()
    size = method_class("fine_tune").planned_size(config, family)
    assert size.parameters == counts["unet"] and size.nbytes == 2 * counts["unet"]
    assert size.elements == sum(counts.values())  # a saved file is the whole model
    planned = planned_bytes(config, size, steps=10)
    assert planned.output == 4 * sum(counts.values())  # output.dtype float32
    adapter = method_class("adapter").planned_size(config.model_copy(update={"method": AdapterMethodConfig()}), family)
    assert adapter.nbytes < size.nbytes / 10


def test_ema_on_the_cpu_swaps_in_and_restores_the_trained_weights(fake_device):
    from modules.optim.ema import EMA

    parameter = nn.Parameter(torch.ones(4, dtype=torch.bfloat16, device=fake_device))
    ema = EMA([parameter], decay=0.5, device=torch.device("cpu"))
    assert ema.shadow[0].device.type == "cpu"
    with torch.no_grad():
        parameter.fill_(3.0)
    ema.update()
    with ema.swapped_in():
        assert torch.equal(parameter.cpu(), torch.full((4,), 2.0, dtype=torch.bfloat16))
    assert parameter.device.type == fake_device.type and torch.equal(parameter.cpu(), torch.full((4,), 3.0, dtype=torch.bfloat16))


def test_small_updates_of_bfloat16_weights_add_up_instead_of_being_lost():
    weights = nn.Parameter(torch.ones(20_000, dtype=torch.bfloat16))
    optimizer = torch.optim.SGD([weights], lr=1e-3)  # each step -1e-3: a quarter of bfloat16's spacing at 1
    step_bfloat16_stochastically(SingleParameterStepper(optimizer, stochastic_rounding=True))
    torch.manual_seed(4)
    for _ in range(10):
        weights.grad = torch.ones_like(weights)
        optimizer.step()
    assert weights.detach().double().mean().item() == pytest.approx(1 - 1e-2, abs=1e-3)


def test_a_tiny_bfloat16_step_that_rounds_back_still_counts_as_a_step_for_the_guard():
    from modules.trainer.guards import TrainingError, check_first_step, snapshot

    weights = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))  # a norm's weight
    optimizer = torch.optim.SGD([weights], lr=1e-7)  # 1e-7 of 0.0078's spacing: almost surely no element moves
    stepper = SingleParameterStepper(optimizer, stochastic_rounding=True)
    before = snapshot([("norm.weight", weights)])
    weights.grad = torch.ones_like(weights)
    stepper.step(weights)
    assert torch.equal(weights.detach(), before["norm.weight"])
    with pytest.raises(TrainingError, match="did not change"):  # what the stored value alone says
        check_first_step([("norm.weight", weights)], before)
    moves = stepper.take_moves()
    check_first_step([("norm.weight", weights)], before, moves={"norm.weight": moves[id(weights)]})
