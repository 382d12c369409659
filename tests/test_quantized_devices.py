"""Quantized layers on a second device: the fake "fakegpu" (tests/fake_device.py) and, where present, CUDA."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import quantized_cases
from modules.quantization.base import QuantizedLinear
from quantized_cases import (
    Case, assert_unchanged, make_input, make_layer, plain_tensor_attributes, relative_error, snapshot,
)


case = quantized_cases.case  # the fixture: every class and mode


FAKE_DEVICE_FILE = Path(__file__).with_name("fake_device.py")


def enable_fake_device_if_present() -> torch.device | None:
    if not FAKE_DEVICE_FILE.exists():
        return None
    sys.path.insert(0, str(FAKE_DEVICE_FILE.parent))
    try:
        # a second import under another name reuses the first registration (fake_device._MARK)
        return importlib.import_module("fake_device").enable_fake_device()
    finally:
        sys.path.remove(str(FAKE_DEVICE_FILE.parent))


# Registered at import (collection), not in a fixture: the autograd engine sizes its per-device
# queues at the first backward of the process, and a device registered after that fails its
# backward with "INTERNAL ASSERT FAILED ... device_ready_queues_".
FAKE_DEVICE = enable_fake_device_if_present()


@pytest.fixture(params=["fakegpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def second_device(request) -> torch.device:
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        return torch.device("cuda", 0)
    if FAKE_DEVICE is None:
        pytest.skip("tests/fake_device.py does not exist yet")
    return FAKE_DEVICE


def same_device(actual: torch.device, expected: torch.device) -> bool:
    # torch.device("fakegpu") has no index; tensors report fakegpu:0
    return actual.type == expected.type and (actual.index or 0) == (expected.index or 0)


def test_unquantized_weight_lands_on_the_asked_device(case, second_device):
    layer = make_layer(case)
    before = snapshot(layer)
    for dtype in (torch.float32, torch.bfloat16):
        weight = layer.unquantized_weight(dtype, second_device)
        assert same_device(weight.device, second_device) and weight.dtype == dtype
        assert torch.equal(weight.cpu(), layer.unquantized_weight(dtype, "cpu"))
    assert_unchanged(layer, before)


def expected_on(device: torch.device, case: Case, layer: QuantizedLinear, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The CPU result the layer's output on `device` should match, and the relative tolerance.

    Off CPU and CUDA every class takes the dequantize + F.linear path; on CUDA the int8 kernel is
    the same integer math as on CPU, the fp8 kernel (CUDA only) rounds activations the fallback keeps.
    """
    dense = F.linear(x, layer.unquantized_weight(torch.float32, "cpu"), layer.bias)
    if device.type == "cuda" and case.id == "w8a8_int8":
        return layer(x), 1e-4
    if device.type == "cuda" and case.id == "w8a8_fp8":
        return dense, 0.07
    return dense, 1e-4 if device.type == "cuda" else 1e-6


def test_layer_moved_to_the_device_keeps_everything_together(case, second_device):
    layer = make_layer(case)
    x = make_input()
    expected, tolerance = expected_on(second_device, case, layer, x)
    dtypes = {name: t.dtype for name, t in layer.offload_tensors().items()}
    layer.to(second_device)
    tensors = layer.offload_tensors()
    assert all(same_device(t.device, second_device) for t in tensors.values()), \
        {name: t.device for name, t in tensors.items()}
    assert {name: t.dtype for name, t in tensors.items()} == dtypes
    assert plain_tensor_attributes(layer) == []

    _forward_and_backward_on(second_device, layer, x, expected, tolerance)

    # moved back (every tensor rebound), a changed scale is still the one read
    layer.to("cpu")
    assert all(t.device == torch.device("cpu") for t in layer.offload_tensors().values())
    bias = layer.bias.detach().clone()
    before = layer(x)
    with torch.no_grad():
        for key in case.scale_keys:
            getattr(layer, key).mul_(2)
    torch.testing.assert_close(layer(x) - bias, 2 * (before - bias), rtol=1e-5, atol=1e-5)


def _forward_and_backward_on(device, layer, x, expected, tolerance):
    """The layer's output and input gradient land on `device`, the output close to `expected`."""
    x_dev = x.to(device).requires_grad_()
    out = layer(x_dev)
    assert same_device(out.device, device)
    assert relative_error(out, expected) < tolerance
    out.sum().backward()
    assert same_device(x_dev.grad.device, device)
    return x_dev, out


def test_layer_parked_on_cpu_runs_on_the_device_of_its_input(case, second_device):
    layer = make_layer(case)
    x = make_input()
    expected, tolerance = expected_on(second_device, case, layer, x)
    x_dev, out = _forward_and_backward_on(second_device, layer, x, expected, tolerance)
    torch.testing.assert_close(x_dev.grad.cpu(), torch.ones_like(out).cpu() @ layer.unquantized_weight(torch.float32, "cpu"),
                               rtol=1e-4, atol=1e-4)
    assert all(t.device == torch.device("cpu") for t in layer.offload_tensors().values())
