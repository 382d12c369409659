"""nf4: bitsandbytes' 4-bit NormalFloat, dequantized in forward (LinearNf4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modules.quantization.weight_modes import LayerOptions, WeightMode, register_weight_mode

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modules.quantization.base import QuantizedLinear


def _layer(linear: nn.Linear, compute_dtype: torch.dtype, options: LayerOptions) -> QuantizedLinear:
    from modules.quantization.linear_nf4 import LinearNf4
    return LinearNf4(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype,
                     device=options.device, double_quant=options.nf4_double_quant)


# 4 bits, plus an 8-bit absmax per 64-block and a float32 per 256 of those (double quant)
register_weight_mode(WeightMode(
    "nf4", 0.53,
    lambda caps: None if caps.bitsandbytes else
    "nf4 needs bitsandbytes (import and a quantize_4bit/dequantize_4bit round trip failed)",
    _layer, how="bitsandbytes nf4, dequantized in forward", auto_tier=2, reads=("nf4_double_quant",)))
