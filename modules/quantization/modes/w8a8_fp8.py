"""w8a8_fp8: float8 weights and activations on torch._scaled_mm (LinearW8A8Fp8)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modules.quantization.weight_modes import LayerOptions, WeightMode, needs_float8, register_weight_mode

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modules.quantization.base import QuantizedLinear

    from modules.quantization.capabilities import Capabilities

# torch._scaled_mm's fp8 kernel needs Ada/Hopper (sm_89+) tensor cores; on older GPUs and other
# devices LinearW8A8 falls back to dequantizing, which works but saves no time.
SCALED_MM_MIN_CAPABILITY = (8, 9)


def _layer(linear: nn.Linear, compute_dtype: torch.dtype, options: LayerOptions) -> QuantizedLinear:
    from modules.quantization.linear_w8a8 import LinearW8A8Fp8
    return LinearW8A8Fp8(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype,
                         device=options.device)


def _scaled_mm_fast(caps: Capabilities) -> str | None:
    if caps.scaled_mm and caps.cuda and (caps.compute_capability or (0, 0)) >= SCALED_MM_MIN_CAPABILITY:
        return None
    major, minor = SCALED_MM_MIN_CAPABILITY
    return f"torch._scaled_mm's fast path needs CUDA with compute capability >= {major}.{minor}"


register_weight_mode(WeightMode("w8a8_fp8", 1.01, needs_float8("w8a8_fp8"), _layer, fast_kernel=_scaled_mm_fast,
                                how="torch._scaled_mm"))
