"""Replace a part's Linear layers with quantized ones: one verb, modes as data.

`quantize_model_(model, part, mode, ...)` works on a loaded dense model. The streamed loader
(modules/loading/streamed_load.py) uses the same two steps, `new_quantized_layer` and
`load_dense_weight`, so each layer is quantized the moment its weight is read and the dense
tensor is released before the next one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from modules.quantization.base import QuantizedLinear
from modules.quantization.skip_rules import skip_reason
from modules.quantization.torchao_int8 import quantize_int8_

DENSE_MODES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZED_MODES = ("float8", "int8", "w8a8_int8", "w8a8_fp8", "nf4")


def is_quantized_mode(mode: str) -> bool:
    return mode in QUANTIZED_MODES


@dataclass
class QuantizationReport:
    mode: str
    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> why it stays dense

    def summary(self, part: str) -> str:
        return (f"model.parts.{part}: {len(self.quantized)} Linear layers stored as {self.mode}, "
                f"{len(self.skipped)} kept dense")


def quantized_layer_class(mode: str) -> type[QuantizedLinear]:
    # imported here: each class pulls its own kernels (bitsandbytes for nf4) only when used
    if mode == "float8":
        from modules.quantization.linear_fp8 import LinearFp8
        return LinearFp8
    if mode == "w8a8_int8":
        from modules.quantization.linear_w8a8 import LinearW8A8Int8
        return LinearW8A8Int8
    if mode == "w8a8_fp8":
        from modules.quantization.linear_w8a8 import LinearW8A8Fp8
        return LinearW8A8Fp8
    if mode == "nf4":
        from modules.quantization.linear_nf4 import LinearNf4
        return LinearNf4
    raise ValueError(f"{mode!r} is not a QuantizedLinear mode")


def plan_layers(model: nn.Module, part: str, user_skip: list[str]) -> tuple[list[str], dict[str, str]]:
    """Names of the Linear layers to quantize, and the skipped ones with the reason."""
    targets, skipped = [], {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        reason = skip_reason(model, part, name, module, user_skip)
        if reason:
            skipped[name] = reason
        else:
            targets.append(name)
    return targets, skipped


def new_quantized_layer(mode: str, linear: nn.Linear, compute_dtype: torch.dtype,
                        nf4_double_quant: bool = True) -> nn.Module:
    """An empty layer of `mode` shaped like `linear`, with its (small) storage on the CPU.

    int8 goes through torchao, which quantizes a real dense Linear: that Linear stays on the meta
    device (no memory) until its weight arrives.
    """
    if mode == "int8":
        layer = nn.Linear(linear.in_features, linear.out_features, linear.bias is not None,
                          device="meta", dtype=compute_dtype)
        return layer.requires_grad_(False)
    cls = quantized_layer_class(mode)
    options = {"double_quant": nf4_double_quant} if mode == "nf4" else {}
    return cls(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype,
               device="cpu", **options)


@torch.no_grad()
def load_dense_weight(layer: nn.Module, name: str, tensor: torch.Tensor, compute_dtype: torch.dtype) -> None:
    """Give a layer made by new_quantized_layer its `weight` or `bias` from a dense tensor."""
    if isinstance(layer, QuantizedLinear):
        if name == "weight":
            layer.quantize_weight(tensor)
        else:
            layer.set_bias(tensor)
        return
    # torchao int8: materialise the dense weight, quantize it at once, let the dense copy go
    value = nn.Parameter(tensor.to(device="cpu", dtype=compute_dtype), requires_grad=False)
    setattr(layer, name, value)
    if name == "weight":
        quantize_int8_(layer)


@torch.no_grad()
def quantize_model_(model: nn.Module, part: str, mode: str, compute_dtype: torch.dtype,
                    user_skip: list[str] | None = None, nf4_double_quant: bool = True) -> QuantizationReport:
    """Quantize a loaded dense model's Linear layers in place (on the device they sit on)."""
    report = QuantizationReport(mode)
    targets, report.skipped = plan_layers(model, part, user_skip or [])
    for name in targets:
        linear = model.get_submodule(name)
        layer = new_quantized_layer(mode, linear, compute_dtype, nf4_double_quant)
        load_dense_weight(layer, "weight", linear.weight, compute_dtype)
        if linear.bias is not None:
            load_dense_weight(layer, "bias", linear.bias, compute_dtype)
        model.set_submodule(name, layer.to(linear.weight.device) if isinstance(layer, QuantizedLinear) else layer)
        report.quantized.append(name)
    return report
