"""The W8A8 kernel paths (int8 _int_mm, fp8 _scaled_mm): when they run, and that they agree with the dense fallback."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modules.quantization.linear_w8a8 as w8a8
from modules.quantization.linear_w8a8 import LinearW8A8, LinearW8A8Fp8, LinearW8A8Int8
from quantized_cases import IN, OUT, dense_linear, make_input, relative_error


def emulated_w8a8(layer: LinearW8A8, x: torch.Tensor) -> torch.Tensor:
    """What the 8-bit kernels compute: per-token quantized activations times the stored weight, in float64."""
    x2d = x.reshape(-1, IN).to(layer.compute_dtype)
    codes, scale = w8a8.quantize_rows(x2d, layer.weight_format)
    x_deq = codes.double() * scale.double()[:, None]
    w_deq = layer.weight.double() * layer.scale.double()[:, None]
    return (x_deq @ w_deq.t()).reshape(*x.shape[:-1], OUT)


def test_int8_kernel_runs_on_cpu_and_agrees_with_the_fallback(monkeypatch):
    layer = LinearW8A8Int8.from_linear(dense_linear(bias=False), torch.float32)
    x = make_input()
    assert layer.kernel_path(x.reshape(-1, IN)) == "int_mm"
    kernel = layer(x)
    # the kernel's output is the quantized math, scales included, to float32 rounding
    torch.testing.assert_close(kernel.double(), emulated_w8a8(layer, x), rtol=1e-5, atol=1e-5)

    monkeypatch.setattr(w8a8, "USE_KERNELS", False)
    assert layer.kernel_path(x.reshape(-1, IN)) == "dense"
    fallback = layer(x)
    assert not torch.equal(kernel, fallback)  # two paths really ran
    assert relative_error(kernel, fallback) < 0.02


def test_fp8_kernel_math_matches_the_emulation():
    # _scaled_mm is a CUDA speed path; where this torch also runs it on CPU, its scales are checked here
    layer = LinearW8A8Fp8.from_linear(dense_linear(bias=False), torch.float32)
    x = make_input()
    assert layer.kernel_path(x.reshape(-1, IN)) == "dense"  # not chosen on CPU
    codes, scale = w8a8.quantize_rows(x.reshape(-1, IN), "fp8")
    try:
        out = w8a8.fp8_matmul(codes, scale, layer.weight, layer.scale, torch.float32)
    except (RuntimeError, NotImplementedError) as error:
        pytest.skip(f"torch._scaled_mm does not run on CPU here: {error}")
    torch.testing.assert_close(out.double().reshape(4, 20, OUT), emulated_w8a8(layer, x), rtol=1e-5, atol=1e-5)
    assert relative_error(out.reshape(4, 20, OUT), layer(x)) < 0.07


def test_kernel_guards_follow_device_type_and_shape():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert w8a8.int8_kernel_runs(cpu, 3, 5, 7)  # CPU's _int_mm takes any shape
    assert w8a8.int8_kernel_runs(cuda, 17, 64, 48)
    assert not w8a8.int8_kernel_runs(cuda, 16, 64, 48)  # cuBLAS wants more than 16 rows
    assert not w8a8.int8_kernel_runs(cuda, 32, 60, 48)
    assert not w8a8.int8_kernel_runs(cuda, 32, 64, 44)
    # any other device (a test device, xpu, mps) takes the fallback: not "anything but cpu is cuda"
    assert not w8a8.int8_kernel_runs(torch.device("meta"), 32, 64, 48)
    assert not w8a8.fp8_kernel_runs(cpu, 32, 64, 48)
    assert not w8a8.fp8_kernel_runs(torch.device("meta"), 32, 64, 48)


def test_int8_kernel_handles_few_tokens_and_odd_shapes():
    torch.manual_seed(3)
    linear = nn.Linear(37, 11)
    layer = LinearW8A8Int8.from_linear(linear, torch.float32)
    for x in (torch.randn(1, 37), torch.randn(2, 3, 37)):
        assert relative_error(layer(x), linear(x)) < 0.03


def test_w8a8_weight_format_option():
    layer = LinearW8A8(IN, OUT, True, torch.float32, weight_format="fp8")
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.mode == "w8a8_fp8"
    assert LinearW8A8(IN, OUT, True, torch.float32).weight.dtype == torch.int8
    assert LinearW8A8Fp8.mode == "w8a8_fp8" and LinearW8A8Int8.mode == "w8a8_int8"
    with pytest.raises(ValueError, match="weight_format"):
        LinearW8A8(IN, OUT, True, torch.float32, weight_format="int4")
    with pytest.raises(ValueError, match="stores int8"):
        LinearW8A8Int8(IN, OUT, True, torch.float32, weight_format="fp8")


@pytest.mark.cuda
def test_w8a8_kernels_on_cuda_agree_with_the_fallback(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for cls in (LinearW8A8Int8, LinearW8A8Fp8):
        layer = cls.from_linear(dense_linear(bias=False), torch.bfloat16).to("cuda")
        x = make_input(device="cuda")
        path = layer.kernel_path(x.reshape(-1, IN))
        kernel = layer(x)
        monkeypatch.setattr(w8a8, "USE_KERNELS", False)
        fallback = layer(x)
        monkeypatch.setattr(w8a8, "USE_KERNELS", True)
        assert relative_error(kernel, fallback) < 0.07, path
        if cls is LinearW8A8Int8:
            assert path == "int_mm"
