"""Quantized layers in forward and backward: close to the dense layer, in the compute dtype, no dense weight kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import quantized_cases
from quantized_cases import IN, OUT, dense_linear, make_input, make_layer, relative_error


case = quantized_cases.case  # the fixture: every class and mode


def test_forward_is_close_to_the_dense_layer(case):
    linear = dense_linear()
    layer = case.cls.from_linear(linear, torch.float32, **case.options)
    x = make_input()
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (4, 20, OUT)
    assert relative_error(out, linear(x)) < case.forward_tolerance
    # and close to the dense math on its own dequantized weight (the kernels' activation rounding only)
    own = F.linear(x, layer.unquantized_weight(torch.float32, "cpu"), layer.bias)
    assert relative_error(out, own) < 0.03


@pytest.mark.parametrize("compute_dtype,input_dtype", [
    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
    (torch.float32, torch.bfloat16)])
def test_output_dtype_is_the_compute_dtype(case, compute_dtype, input_dtype):
    linear = dense_linear()
    layer = case.cls.from_linear(linear, compute_dtype, **case.options)
    x = make_input(dtype=input_dtype)
    out = layer(x)
    assert out.dtype == compute_dtype
    assert relative_error(out, linear(x.float())) < case.forward_tolerance + 0.02


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_gradient_reaches_the_input_through_the_dequantized_weight(case, compute_dtype):
    layer = make_layer(case, compute_dtype=compute_dtype)
    x = make_input().requires_grad_()
    out = layer(x)
    torch.manual_seed(2)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    weight = layer.unquantized_weight(compute_dtype, "cpu")
    expected = (grad_out.to(compute_dtype) @ weight).float()
    assert x.grad is not None and x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-5)
    for name, tensor in layer.offload_tensors().items():
        assert tensor.grad is None and not tensor.requires_grad, name


def test_backward_does_not_keep_a_dense_weight_alive(case):
    # autograd keeping each layer's dequantized weight until backward would undo the quantization
    layer = make_layer(case)
    saved: list[torch.Size] = []

    def pack(tensor):
        saved.append(tensor.shape)
        return tensor

    x = make_input().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer(x)
    assert not [shape for shape in saved if shape.numel() == OUT * IN]
    out.sum().backward()
    assert x.grad is not None


def test_saved_weight_detector_is_not_vacuous():
    # the same hook sees the weight that plain F.linear keeps for its backward
    saved = []
    weight = dense_linear().weight.detach()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        F.linear(make_input().requires_grad_(), weight)
    assert [shape for shape in saved if shape.numel() == OUT * IN]
