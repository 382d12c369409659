"""w8a8_int8: int8 weights and activations on torch._int_mm (LinearW8A8Int8)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modules.quantization.weight_modes import LayerOptions, WeightMode, register_weight_mode

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modules.quantization.base import QuantizedLinear


def _layer(linear: nn.Linear, compute_dtype: torch.dtype, options: LayerOptions) -> QuantizedLinear:
    from modules.quantization.linear_w8a8 import LinearW8A8Int8
    return LinearW8A8Int8(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype,
                          device=options.device)


# works everywhere thanks to its dequantize fallback (and rounds activations: auto's last 8-bit resort)
register_weight_mode(WeightMode(
    "w8a8_int8", 1.01, lambda caps: None, _layer,
    fast_kernel=lambda caps: None if caps.int_mm else f"torch._int_mm does not run on {caps.device}",
    how="torch._int_mm", auto_tier=1, auto_preference=2))
