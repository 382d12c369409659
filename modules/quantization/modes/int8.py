"""int8: torchao's int8 weight-only storage and kernel (LinearInt8)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modules.quantization.weight_modes import LayerOptions, WeightMode, register_weight_mode

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modules.quantization.base import QuantizedLinear


def _layer(linear: nn.Linear, compute_dtype: torch.dtype, options: LayerOptions) -> QuantizedLinear:
    from modules.quantization.torchao_int8 import LinearInt8
    return LinearInt8(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype,
                      device=options.device)


# one byte per weight plus a scale per output channel (~1% on small layers)
register_weight_mode(WeightMode(
    "int8", 1.01,
    lambda caps: None if caps.torchao_int8 else
    "int8 needs a working torchao (from torchao.quantization import quantize_, Int8WeightOnlyConfig "
    "must import and really quantize a Linear)",
    _layer, how="torchao int8 weight-only", auto_tier=1, auto_preference=0))
