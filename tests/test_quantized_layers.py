"""The quantized linear layers keep the QuantizedLinear contract (docs/architecture.md, "Contracts the tests pin").

Every contract test runs for every class and mode: LinearFp8, LinearInt8 (torchao), LinearW8A8 (int8
and fp8 weights) and LinearNf4 (with and without double quantization).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import quantized_cases
from modules.quantization.base import QuantizedLinear
from modules.quantization.linear_nf4 import LinearNf4
from quantized_cases import (
    CASES, IN, OUT, Case, assert_unchanged, dense_linear, make_input, make_layer, plain_tensor_attributes, raw_bytes,
    snapshot, weight_tolerance,
)


case = quantized_cases.case  # the fixture: every class and mode


ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------
# unquantized_weight, offload_tensors, no aliases
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_unquantized_weight_is_close_in_the_asked_dtype_and_changes_nothing(case, dtype):
    linear = dense_linear()
    layer = case.cls.from_linear(linear, torch.bfloat16, **case.options)
    before = snapshot(layer)

    weight = layer.unquantized_weight(dtype, "cpu")
    assert weight.dtype == dtype and weight.device == torch.device("cpu") and weight.shape == (OUT, IN)
    dense = linear.weight.detach()
    # the output dtype's own rounding on top of the mode's
    tolerance = weight_tolerance(case, dense)
    rounding = (dense.abs() + tolerance) * {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}.get(dtype, 0)
    assert ((weight.double() - dense.double()).abs() <= tolerance + rounding).all()
    # rounded once, from the exact dequantized value (no scale rounded to a narrow dtype first)
    assert torch.equal(weight, layer.unquantized_weight(torch.float64, "cpu").to(dtype))
    assert weight.requires_grad is False

    # the result is a new tensor: writing into it does not reach the storage
    weight.add_(1)
    assert_unchanged(layer, before)


def test_nf4_tolerance_is_not_vacuous():
    # the nf4 bound is loose; a dequantization with a wrong absmax (every block scaled by 1.3) breaks it
    case = next(c for c in CASES if c.id == "nf4")
    linear = dense_linear()
    layer = case.cls.from_linear(linear, torch.float32, **case.options)
    dense = linear.weight.detach()
    wrong = layer.unquantized_weight(torch.float32, "cpu") * 1.3
    assert not ((wrong - dense).abs() <= weight_tolerance(case, dense)).all()


@pytest.mark.parametrize("bias", [True, False])
def test_offload_tensors_are_exactly_the_parameters_and_buffers(case, bias):
    layer = make_layer(case, bias=bias)
    tensors = layer.offload_tensors()
    expected = {"weight", *case.buffers} | ({"bias"} if bias else set())
    assert set(tensors) == expected
    registered = dict(layer.named_parameters()) | dict(layer.named_buffers())
    assert set(registered) == expected
    assert all(tensors[name] is registered[name] for name in expected)
    # every one of them is saved: a fresh layer is rebuilt from the state dict alone
    assert set(layer.state_dict()) == expected


def test_no_tensor_is_held_outside_parameters_and_buffers(case):
    layer = make_layer(case)
    x = make_input().requires_grad_()
    layer(x).sum().backward()
    layer.unquantized_weight(torch.float32, "cpu")
    assert plain_tensor_attributes(layer) == []
    if isinstance(layer, LinearNf4):
        # the QuantState is rebuilt per call, never cached on the layer
        assert not any(type(value).__name__ == "QuantState" for value in vars(layer).values())


def test_alias_detector_finds_hidden_tensors():
    layer = make_layer(CASES[0])
    holder = type("QuantStateLike", (), {})()
    holder.absmax = layer.scale
    layer.cached_state = holder
    layer.cached_list = [(1, layer.scale)]
    assert sorted(plain_tensor_attributes(layer)) == ["cached_list.0.1", "cached_state.absmax"]


# ---------------------------------------------------------------------------------------------------
# scales are read through the buffers: load_state_dict and Module._apply rebind them
# ---------------------------------------------------------------------------------------------------


def doubled_state(layer: QuantizedLinear, case: Case) -> dict:
    state = {name: tensor.clone() for name, tensor in layer.state_dict().items()}
    for key in case.scale_keys:
        state[key] = state[key] * 2
    return state


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_with_a_new_scale_changes_the_output(case, assign):
    layer = make_layer(case, bias=False)
    x = make_input()
    before = layer(x)
    layer.load_state_dict(doubled_state(layer, case), assign=assign)
    # doubling a scale is exact in floating point, so the output doubles exactly
    torch.testing.assert_close(layer(x), before * 2, rtol=1e-6, atol=0)
    torch.testing.assert_close(layer.unquantized_weight(torch.float32, "cpu"),
                               2 * case.cls.from_linear(dense_linear(False), torch.float32, **case.options)
                               .unquantized_weight(torch.float32, "cpu"), rtol=1e-6, atol=0)
    assert all(not t.requires_grad for t in layer.offload_tensors().values())


def test_forward_follows_buffers_rebound_by_apply(case):
    # Module.to(device) rebinds every buffer to a new tensor; cloning does the same on one device.
    layer = make_layer(case, bias=False)
    x = make_input()
    before = layer(x)
    old = layer.offload_tensors()
    layer._apply(lambda t: t.clone())
    assert all(getattr(layer, name) is not old[name] for name in case.buffers)  # really rebound
    with torch.no_grad():
        for key in case.scale_keys:
            getattr(layer, key).mul_(2)
    torch.testing.assert_close(layer(x), before * 2, rtol=1e-6, atol=0)
    # the old tensors were not the ones read
    for key in case.scale_keys:
        assert not torch.equal(old[key], getattr(layer, key))


@pytest.mark.parametrize("cast", ["half", "float", "to_bfloat16"])
def test_module_dtype_casts_keep_the_quantized_storage(case, cast):
    # model.half() / model.to(bf16) must not widen fp8 codes or narrow float32 scales
    layer = make_layer(case, compute_dtype=torch.bfloat16)
    x = make_input()
    before, dtypes = layer(x), {name: t.dtype for name, t in layer.offload_tensors().items()}
    snap = snapshot(layer)
    {"half": layer.half, "float": layer.float, "to_bfloat16": lambda: layer.to(torch.bfloat16)}[cast]()
    assert {name: t.dtype for name, t in layer.offload_tensors().items()} == dtypes
    for name, (values, *_rest) in snap.items():
        assert torch.equal(raw_bytes(layer.offload_tensors()[name]), raw_bytes(values))
    assert torch.equal(layer(x), before)


# ---------------------------------------------------------------------------------------------------
# state dict round trip
# ---------------------------------------------------------------------------------------------------


def test_state_dict_round_trip_gives_identical_outputs(case):
    from safetensors.torch import load, save

    layer = make_layer(case, compute_dtype=torch.bfloat16)
    # through safetensors bytes too: what a checkpoint on disk goes through
    state = load(save(layer.state_dict()))
    fresh = case.cls(IN, OUT, True, torch.bfloat16, **case.options)
    fresh.load_state_dict(state)
    x = make_input()
    assert torch.equal(fresh(x), layer(x))
    assert torch.equal(fresh.unquantized_weight(torch.float32, "cpu"), layer.unquantized_weight(torch.float32, "cpu"))


def test_state_dict_with_other_options_is_refused():
    double = make_layer(next(c for c in CASES if c.id == "nf4"))
    single = LinearNf4(IN, OUT, True, torch.float32, double_quant=False)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        single.load_state_dict(double.state_dict())


# ---------------------------------------------------------------------------------------------------
# sizes, imports
# ---------------------------------------------------------------------------------------------------


def weight_bytes_ratio(layer: QuantizedLinear) -> float:
    stored = sum(t.numel() * t.element_size() for name, t in layer.offload_tensors().items() if name != "bias")
    return stored / (layer.in_features * layer.out_features * torch.bfloat16.itemsize)


def test_weight_bytes_relative_to_bfloat16(case):
    layer = case.cls(1024, 1024, True, torch.bfloat16, **case.options)
    layer.quantize_weight(torch.randn(1024, 1024))
    ratio = weight_bytes_ratio(layer)
    assert ratio <= (0.30 if case.cls is LinearNf4 else 0.52), ratio


def test_nf4_module_imports_without_bitsandbytes():
    code = ("import sys; import modules.quantization.linear_nf4; "
            "assert 'bitsandbytes' not in sys.modules, 'imported eagerly'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
