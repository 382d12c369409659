"""The quantized linear layers keep the QuantizedLinear contract (DESIGN.md, "Contracts that tests pin").

Every contract test runs for every class and mode: LinearFp8, LinearInt8 (torchao), LinearW8A8 (int8
and fp8 weights) and LinearNf4 (with and without double quantization).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modules.quantization.linear_w8a8 as w8a8
from modules.quantization.base import QuantizedLinear
from modules.quantization.linear_fp8 import LinearFp8
from modules.quantization.linear_nf4 import LinearNf4
from modules.quantization.linear_w8a8 import LinearW8A8, LinearW8A8Fp8, LinearW8A8Int8
from modules.quantization.torchao_int8 import LinearInt8

ROOT = Path(__file__).resolve().parents[1]
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

# 48 x 64: the weight's shape is unlike any activation's, and both dims are multiples of 16 so the
# 8-bit kernels take it; 4 x 20 tokens = 80 rows (> 16, what CUDA's _int_mm needs)
IN, OUT = 64, 48


@dataclass(frozen=True)
class Case:
    id: str
    cls: type[QuantizedLinear]
    options: dict = field(default_factory=dict)
    # stored tensors besides weight and bias
    buffers: tuple[str, ...] = ()
    # buffers whose doubling doubles the dense weight
    scale_keys: tuple[str, ...] = ()
    # |forward - dense forward| / |dense forward| must stay under this
    forward_tolerance: float = 0.0


CASES = [
    Case("fp8", LinearFp8, {}, ("scale",), ("scale",), 0.05),
    Case("int8", LinearInt8, {}, ("scale",), ("scale",), 0.02),
    Case("w8a8_int8", LinearW8A8Int8, {}, ("scale",), ("scale",), 0.02),
    Case("w8a8_fp8", LinearW8A8Fp8, {}, ("scale",), ("scale",), 0.07),
    Case("nf4", LinearNf4, {"double_quant": True},
         ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "nested_offset"),
         ("nested_absmax", "nested_offset"), 0.15),
    Case("nf4_single", LinearNf4, {"double_quant": False}, ("absmax", "quant_map"), ("absmax",), 0.15),
]


@pytest.fixture(params=CASES, ids=[case.id for case in CASES])
def case(request) -> Case:
    return request.param


def dense_linear(bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        # rows of different magnitude: per-channel scales matter, a per-tensor bug shows
        linear.weight.mul_(torch.linspace(0.2, 3.0, OUT)[:, None])
        if bias:
            linear.bias.normal_()
    return linear


def make_layer(case: Case, compute_dtype=torch.float32, bias: bool = True) -> QuantizedLinear:
    return case.cls.from_linear(dense_linear(bias), compute_dtype, **case.options)


def make_input(seed: int = 1, dtype=torch.float32, device="cpu") -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(4, 20, IN, dtype=dtype).to(device)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return ((actual - expected).norm() / expected.norm()).item()


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    # compare raw bytes: fp8 has no CPU equality kernel, and bytes are what "unchanged" means
    return tensor.detach().cpu().reshape(-1).view(torch.uint8)


def snapshot(layer: QuantizedLinear) -> dict:
    return {name: (t.detach().clone(), t.data_ptr(), t.dtype, t.device, t.shape)
            for name, t in layer.offload_tensors().items()}


def assert_unchanged(layer: QuantizedLinear, before: dict) -> None:
    after = layer.offload_tensors()
    assert after.keys() == before.keys()
    for name, (values, ptr, dtype, device, shape) in before.items():
        tensor = after[name]
        assert (tensor.data_ptr(), tensor.dtype, tensor.device, tensor.shape) == (ptr, dtype, device, shape), name
        assert torch.equal(raw_bytes(tensor), raw_bytes(values)), name


def tensor_holders(value, path: str, depth: int = 0, seen: set | None = None) -> list[str]:
    """Paths under `value` that reach a torch.Tensor (through lists, tuples, dicts, object attributes)."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        return [path]
    if depth > 4 or id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type, torch.dtype,
                                                           torch.device, torch.Size, nn.Module)):
        return []
    seen.add(id(value))
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = enumerate(value)
    elif hasattr(value, "__dict__"):
        items = vars(value).items()
    else:
        return []
    return [hit for key, item in items for hit in tensor_holders(item, f"{path}.{key}", depth + 1, seen)]


def plain_tensor_attributes(layer: nn.Module) -> list[str]:
    """Tensors the layer holds outside its registered parameters and buffers."""
    return [hit for name, value in vars(layer).items() if name not in ("_parameters", "_buffers", "_modules")
            for hit in tensor_holders(value, name)]


def weight_tolerance(case: Case, dense: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |dequantized - dense| for the mode."""
    if case.cls is LinearFp8:
        # e4m3 keeps 3 mantissa bits: rounding costs at most 1/16 of the value, plus the subnormal step
        scale = dense.abs().amax() / 448
        return dense.abs() / 16 + scale * 2 ** -9 + 1e-7
    if case.id == "w8a8_fp8":
        scale = dense.abs().amax(dim=1, keepdim=True) / 448
        return dense.abs() / 16 + scale * 2 ** -9 + 1e-7
    if case.id in ("w8a8_int8", "int8"):
        # round to nearest of 255 levels per row: half a step of amax/127
        return (dense.abs().amax(dim=1, keepdim=True) / 127 / 2 * 1.001 + 1e-7).expand_as(dense)
    # nf4: the widest gap between NF4 levels is 0.277 of the block absmax (0.723 .. 1.0), so
    # rounding costs about 0.14 of it (0.153 measured); the 8-bit double-quantized absmax adds more
    # (0.18 measured). Loose, but a wrong absmax (see test_nf4_tolerance_is_not_vacuous) breaks it.
    blocks = dense.reshape(-1, 64).abs().amax(dim=1, keepdim=True)
    return (blocks * 0.2).expand(-1, 64).reshape(dense.shape)


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
# forward and backward
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# W8A8 kernel paths
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# fp8 checkpoints that are already quantized (ComfyUI scaled fp8)
# ---------------------------------------------------------------------------------------------------


def scaled_fp8_checkpoint(seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    codes = (torch.randn(OUT, IN) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, torch.tensor(0.0123)


@pytest.mark.parametrize("scale_shape", [(), (1,)])
def test_scaled_fp8_weights_keep_their_scale(scale_shape):
    codes, scale = scaled_fp8_checkpoint()
    bias = torch.randn(OUT)
    layer = LinearFp8.from_quantized(codes, scale.reshape(scale_shape), bias, torch.float32)
    assert torch.equal(raw_bytes(layer.weight), raw_bytes(codes))  # stored bit for bit
    assert layer.scale.item() == scale.item() and layer.scale.shape == ()
    expected = codes.float() * scale
    assert torch.equal(layer.unquantized_weight(torch.float32, "cpu"), expected)
    x = make_input()
    torch.testing.assert_close(layer(x), F.linear(x, expected, bias))


def test_scaled_fp8_with_a_per_channel_scale_is_requantized_with_it():
    codes, _ = scaled_fp8_checkpoint()
    scale = torch.linspace(0.001, 0.05, OUT)[:, None]
    layer = LinearFp8(IN, OUT, False, torch.float32)
    layer.set_quantized(codes, scale)
    expected = codes.float() * scale
    error = (layer.unquantized_weight(torch.float32, "cpu") - expected).abs()
    assert (error <= expected.abs() / 16 + layer.scale * 2 ** -9 + 1e-7).all()


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


# ---------------------------------------------------------------------------------------------------
# a second device: the fake "fakegpu" (tests/fake_device.py) and, where present, CUDA
# ---------------------------------------------------------------------------------------------------


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

    x_dev = x.to(second_device).requires_grad_()
    out = layer(x_dev)
    assert same_device(out.device, second_device)
    assert relative_error(out, expected) < tolerance
    out.sum().backward()
    assert same_device(x_dev.grad.device, second_device)

    # moved back (every tensor rebound), a changed scale is still the one read
    layer.to("cpu")
    assert all(t.device == torch.device("cpu") for t in layer.offload_tensors().values())
    bias = layer.bias.detach().clone()
    before = layer(x)
    with torch.no_grad():
        for key in case.scale_keys:
            getattr(layer, key).mul_(2)
    torch.testing.assert_close(layer(x) - bias, 2 * (before - bias), rtol=1e-5, atol=1e-5)


def test_layer_parked_on_cpu_runs_on_the_device_of_its_input(case, second_device):
    layer = make_layer(case)
    x = make_input()
    expected, tolerance = expected_on(second_device, case, layer, x)
    x_dev = x.to(second_device).requires_grad_()
    out = layer(x_dev)
    assert same_device(out.device, second_device)
    assert relative_error(out, expected) < tolerance
    out.sum().backward()
    assert same_device(x_dev.grad.device, second_device)
    torch.testing.assert_close(x_dev.grad.cpu(), torch.ones_like(out).cpu() @ layer.unquantized_weight(torch.float32, "cpu"),
                               rtol=1e-4, atol=1e-4)
    assert all(t.device == torch.device("cpu") for t in layer.offload_tensors().values())


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
