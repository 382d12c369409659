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
from modules.quantization.weight_modes import (  # noqa: F401  (QUANTIZED_MODES re-exported)
    QUANTIZED_MODES,
    LayerOptions,
    get_weight_mode,
    is_weight_mode,
)


def is_quantized_mode(mode: str) -> bool:
    return is_weight_mode(mode) and not get_weight_mode(mode).dense


@dataclass
class QuantizationReport:
    mode: str
    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> why it stays dense

    def summary(self, part: str) -> str:
        return (f"model.parts.{part}: {len(self.quantized)} Linear layers stored as {self.mode}, "
                f"{len(self.skipped)} kept dense")


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
                        options: LayerOptions = LayerOptions()) -> QuantizedLinear:
    """An empty layer of `mode` shaped like `linear`, with its (small) storage on `options.device`
    and the part's options (`ModelPartConfig.layer_options`): the mode's layer factory (weight_modes.py)."""
    factory = get_weight_mode(mode).layer_factory
    if factory is None:
        raise ValueError(f"{mode!r} is a dense dtype, not a quantized weight mode")
    return factory(linear, compute_dtype, options)


@torch.no_grad()
def load_dense_weight(layer: QuantizedLinear, name: str, tensor: torch.Tensor, compute_dtype: torch.dtype,
                      work_device: torch.device | None = None) -> None:
    """Give a layer made by new_quantized_layer its `weight` (quantized at once, so the dense copy
    can go) or `bias` from a dense tensor.

    With `work_device` (an accelerator) the weight is quantized there, not where the layer is
    stored: bitsandbytes and torchao take milliseconds on a GPU for what costs seconds on the CPU.
    A layer stored elsewhere (the temp device: it will be parked) visits the work device for its
    own quantization only and goes back, so the device holds one layer's dense weight at a time.
    """
    if name != "weight":
        layer.set_bias(tensor)
        return
    if work_device is None:
        layer.quantize_weight(tensor)
        return
    home = layer.storage_device()
    layer.to(work_device)  # no copy where the layer is stored there already
    layer.quantize_weight(tensor.to(work_device))
    layer.to(home)


@torch.no_grad()
def quantize_model_(model: nn.Module, part: str, mode: str, compute_dtype: torch.dtype,
                    user_skip: list[str] | None = None, options: LayerOptions = LayerOptions()) -> QuantizationReport:
    """Quantize a loaded dense model's Linear layers in place (on the device they sit on)."""
    report = QuantizationReport(mode)
    targets, report.skipped = plan_layers(model, part, user_skip or [])
    for name in targets:
        linear = model.get_submodule(name)
        layer = new_quantized_layer(mode, linear, compute_dtype, options)
        load_dense_weight(layer, "weight", linear.weight, compute_dtype)
        if linear.bias is not None:
            load_dense_weight(layer, "bias", linear.bias, compute_dtype)
        model.set_submodule(name, layer.to(linear.weight.device))
        report.quantized.append(name)
    return report
