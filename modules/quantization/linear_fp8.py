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
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
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


def scaled_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      device: torch.device | str) -> torch.Tensor:
    """`codes * scale` (scale broadcast against codes) as a new tensor on `device` in `dtype`."""
    # move the 1-byte codes before widening them: the transfer is a quarter of float32's
    codes = codes.detach().to(device=device)
    scale = scale.detach().to(device=device)
    if dtype.itemsize < 4:
        # multiply in float32 and round once: a scale rounded to bf16 first would be off by up to
        # 2^-8, the same way for a whole channel (a gain error, not noise), and fp16 underflows
        # small scales. The price is a transient float32 copy of the weight.
        return (codes.to(torch.float32) * scale.to(torch.float32)).to(dtype)
    return codes.to(dtype) * scale.to(dtype)
