"""The quantized layer cases (every class and mode, the `case` fixture) and helpers for the test_quantized_*.py files."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from modules.quantization.base import QuantizedLinear
from modules.quantization.linear_fp8 import LinearFp8
from modules.quantization.linear_nf4 import LinearNf4
from modules.quantization.linear_w8a8 import LinearW8A8Fp8, LinearW8A8Int8
from modules.quantization.torchao_int8 import LinearInt8


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
