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


ROWWISE_FLOAT32_REFUSED = "Only bf16 and fp16 high precision output types are supported for row-wise scaling."


@pytest.fixture
def fp8_kernel_on_cpu(monkeypatch):
    """The fp8 kernel path taken on the CPU, with a torch._scaled_mm that refuses float32 output with
    row-wise scales the way RTX 40xx/50xx builds do (ValueError); yields the out_dtypes it was asked for."""
    real, asked = torch._scaled_mm, []

    def scaled_mm(a, b, *, scale_a, scale_b, out_dtype, **options):
        asked.append(out_dtype)
        if out_dtype == torch.float32 and scale_a.numel() > 1:
            raise ValueError(ROWWISE_FLOAT32_REFUSED)
        return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **options)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(w8a8, "fp8_kernel_device", lambda device: True)  # the CPU stands in for an sm_89 GPU
    monkeypatch.setattr(w8a8, "_FP8_OUTPUT_DTYPE", {}, raising=False)  # nothing probed yet
    return asked


def test_fp8_kernel_computes_in_bfloat16_where_float32_output_is_refused(fp8_kernel_on_cpu):
    layers = [LinearW8A8Fp8.from_linear(dense_linear(bias=False), torch.float32) for _ in range(2)]
    x = make_input()
    outs = [layer(x) for layer in layers for _ in range(2)]
    for layer in layers:  # the kernel ran, in bfloat16, and not the dequantize fallback
        assert (layer.last_kernel, layer.last_kernel_dtype) == ("scaled_mm", torch.bfloat16)
    assert all(out.dtype == torch.float32 for out in outs)  # cast back to the compute dtype
    # the refusal was met once, by the probe: not on every call, not once per layer
    assert fp8_kernel_on_cpu.count(torch.float32) == 1
    assert fp8_kernel_on_cpu.count(torch.bfloat16) == 1 + len(outs)  # the probe's fallback, then each call
    torch.testing.assert_close(outs[0].double(), emulated_w8a8(layers[0], x), rtol=0.02, atol=0.02)


def test_fp8_kernel_refused_everywhere_falls_back_without_an_error(fp8_kernel_on_cpu, monkeypatch):
    def refuses(*args, **kwargs):
        raise ValueError(ROWWISE_FLOAT32_REFUSED)

    monkeypatch.setattr(torch, "_scaled_mm", refuses)
    layer = LinearW8A8Fp8.from_linear(dense_linear(bias=False), torch.bfloat16)
    x = make_input()
    assert layer.kernel_path(x.reshape(-1, IN)) == "dense"
    assert relative_error(layer(x), dense_linear(bias=False)(x)) < 0.07
    assert layer.last_kernel == "dense"


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
        if cls is LinearW8A8Fp8 and torch.cuda.get_device_capability() < (8, 9):
            continue  # no fp8 tensor cores: the fallback is the expected path
        expected = "int_mm" if cls is LinearW8A8Int8 else "scaled_mm"
        assert path == expected
        layer(x)
        assert layer.last_kernel == expected  # the fast kernel really ran, not the dequantize fallback


@pytest.mark.cuda
def test_fp8_w8a8_kernel_runs_on_cuda_with_float32_compute():
    # RTX 40xx/50xx refuse float32 output with row-wise scales: the layer computes in bfloat16 there
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs CUDA with fp8 tensor cores (compute capability >= 8.9)")
    layer = LinearW8A8Fp8.from_linear(dense_linear(bias=False), torch.float32).to("cuda")
    x = make_input(device="cuda")
    out = layer(x)
    assert out.dtype == torch.float32 and layer.last_kernel == "scaled_mm"
    assert layer.last_kernel_dtype in (torch.float32, torch.bfloat16)
    assert relative_error(out, dense_linear(bias=False).to("cuda")(x)) < 0.07


def test_capability_probe_asks_for_row_wise_scaling(monkeypatch):
    # a build whose _scaled_mm takes tensor-wise scales only: the layer's call would fail, so no fast path
    from modules.quantization import capabilities

    real = torch._scaled_mm

    def tensor_wise_only(a, b, *, scale_a, scale_b, out_dtype, **options):
        if scale_a.numel() > 1:
            raise RuntimeError("row-wise scaling is not supported on this build")
        return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **options)

    assert capabilities._scaled_mm_works(torch.device("cpu"))  # torch 2.13 CPU runs row-wise scales
    monkeypatch.setattr(torch, "_scaled_mm", tensor_wise_only)
    assert not capabilities._scaled_mm_works(torch.device("cpu"))


def test_the_fp8_probe_runs_when_the_layer_arrives_so_a_compiled_forward_has_no_graph_break(fp8_kernel_on_cpu):
    from modules.quantization.compile_gate import graph_blocker

    layer = LinearW8A8Fp8.from_linear(dense_linear(bias=False), torch.float32).to("cpu")
    assert w8a8._FP8_OUTPUT_DTYPE == {("cpu", torch.float32): torch.bfloat16}  # probed by .to(), eagerly
    assert graph_blocker(layer, make_input()) is None  # the traced forward only reads the cached answer
