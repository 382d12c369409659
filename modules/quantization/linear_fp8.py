"""LinearFp8: weight stored as float8_e4m3fn with one per-tensor scale (weight_dtype "float8").

The dense weight is `weight.to(dtype) * scale`. The same layout is what ComfyUI's "scaled fp8"
checkpoints ship (fp8 weight + a `.scale_weight` tensor), so those load through `set_quantized` /
`from_quantized` with their scale kept, not dropped: dropping it silently rescales every layer.
"""

from __future__ import annotations

import torch
from torch import nn

from modules.quantization.base import QuantizedLinear

FP8_DTYPE = torch.float8_e4m3fn
# largest finite float8_e4m3fn value: the per-tensor scale maps amax onto it
FP8_MAX = torch.finfo(FP8_DTYPE).max


class LinearFp8(QuantizedLinear):
    """State dict: `weight` (float8_e4m3fn, [out, in]), `scale` (float32, 0-dim), `bias` (compute dtype)."""

    mode = "float8"
    keeps_scaled_fp8 = True

    def __init__(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__(in_features, out_features, bias, compute_dtype, device=device)
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.register_buffer("scale", torch.ones((), dtype=torch.float32, device=device))

    @torch.no_grad()
    def quantize_weight(self, weight: torch.Tensor) -> None:
        if weight.shape != self.weight.shape:
            raise ValueError(f"weight of shape {tuple(weight.shape)} for a layer of shape {tuple(self.weight.shape)}")
        dense = weight.detach().to(device=self.weight.device, dtype=torch.float32)
        amax = dense.abs().amax()
        # an all-zero weight has no range to map; any positive scale reproduces it, 1.0 keeps it finite
        scale = bfloat16_exact_ceil(torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))
        # clamp: float8_e4m3fn has no inf, an out-of-range cast would give NaN
        codes = (dense / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        self.weight.copy_(codes)
        self.scale.copy_(scale)

    @torch.no_grad()
    def set_quantized(self, codes: torch.Tensor, scale: torch.Tensor | float) -> None:
        """Take already-quantized weights as they are: `codes * scale` is the dense weight.

        A float8_e4m3fn weight with a per-tensor scale (ComfyUI `scale_weight`, shape [] or [1]) is
        stored bit for bit and the scale becomes this layer's `scale`. Anything else (e5m2 codes,
        a per-channel scale) is dequantized and quantized again, so its scale is still applied.
        """
        scale = torch.as_tensor(scale, dtype=torch.float32)
        if codes.shape != self.weight.shape:
            raise ValueError(f"codes of shape {tuple(codes.shape)} for a layer of shape {tuple(self.weight.shape)}")
        if codes.dtype == FP8_DTYPE and scale.numel() == 1:
            self.weight.copy_(codes.to(self.weight.device))
            self.scale.copy_(scale.reshape(()).to(self.scale.device))
        else:
            self.quantize_weight(codes.to(torch.float32) * scale.to(codes.device))

    @classmethod
    def from_quantized(cls, codes: torch.Tensor, scale: torch.Tensor | float, bias: torch.Tensor | None,
                       compute_dtype: torch.dtype, device: torch.device | str | None = None) -> LinearFp8:
        """A layer from a scaled-fp8 checkpoint's `weight` / `scale_weight` (/ `bias`), on `device`
        (default: where `codes` are)."""
        out_features, in_features = codes.shape
        layer = cls(in_features, out_features, bias is not None, compute_dtype,
                    device=codes.device if device is None else device)
        layer.set_quantized(codes, scale)
        if bias is not None:
            layer.set_bias(bias)
        return layer

    def unquantized_weight(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        return scaled_dequantize(self.weight, self.scale, dtype, device)


def bfloat16_exact_ceil(scale: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16-representable float32 >= each positive finite `scale` (float32).

    A scale bfloat16 holds exactly makes `codes.to(bf16) * scale.to(bf16)` the float32 product
    rounded once (e4m3 and int8 codes times an 8-bit mantissa fit float32's 24 bits), so
    dequantizing never needs a float32 copy of the weight and has no per-channel gain error.
    Rounding up, not to nearest, keeps amax / scale within the codes' range.
    """
    bits = scale.to(torch.float32).contiguous().view(torch.int32)
    # bfloat16 is float32's upper 16 bits: carry any low bits into them, then drop the low bits
    # (shifts, which every backend has; the scale is positive, so the sign bit stays 0)
    return (((bits + 0xFFFF) >> 16) << 16).view(torch.float32)


def scaled_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      device: torch.device | str) -> torch.Tensor:
    """`codes * scale` (scale broadcast against codes) as a new tensor on `device` in `dtype`."""
    if dtype == torch.float16:
        # float16 underflows small scales (below 6e-5 it keeps few mantissa bits)
        return dequantize_through_float32(codes, scale, dtype, device)
    # move the 1-byte codes before widening them: the transfer is a quarter of float32's
    codes = codes.detach().to(device=device)
    # straight into the compute dtype (bfloat16: 3 bytes a weight written and read, not float32's
    # 19); exact for a bfloat16-representable scale (what the quantizers here store, see
    # bfloat16_exact_ceil); a checkpoint's own float32 scale is rounded to bfloat16 first
    # (a gain error of at most 2^-9 on the layer)
    return codes.to(dtype).mul_(scale.detach().to(device=device, dtype=dtype))


def dequantize_through_float32(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                               device: torch.device | str) -> torch.Tensor:
    """`codes * scale` multiplied in float32 and rounded once to `dtype`, for a scale `dtype` does
    not hold exactly; the price is a transient float32 copy of the weight."""
    codes = codes.detach().to(device=device)
    return (codes.to(torch.float32) * scale.detach().to(device=device, dtype=torch.float32)).to(dtype)
