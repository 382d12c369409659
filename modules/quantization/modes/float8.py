"""float8: e4m3 storage with one scale per tensor, dequantized in forward (LinearFp8)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modules.quantization.weight_modes import LayerOptions, WeightMode, needs_float8, register_weight_mode

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modules.quantization.base import QuantizedLinear


def _layer(linear: nn.Linear, compute_dtype: torch.dtype, options: LayerOptions) -> QuantizedLinear:
    from modules.quantization.linear_fp8 import LinearFp8
    return LinearFp8(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype,
                     device=options.device)


# one byte per weight plus its scale
register_weight_mode(WeightMode("float8", 1.01, needs_float8("float8"), _layer,
                                how="e4m3 storage, dequantized in forward", auto_tier=1, auto_preference=1))
