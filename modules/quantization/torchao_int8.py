"""LinearInt8: int8 weight-only storage through torchao (weight_dtype "int8").

torchao quantizes (`quantize_` with `Int8WeightOnlyConfig`) and runs the matmul (its `Int8Tensor`
dispatches F.linear to an int8 weight-only kernel). Its result is a tensor subclass that hides the
codes and the scale inside the weight; kept like that, the layer would break the QuantizedLinear
contract (a scale that is no registered buffer, a state dict safetensors cannot write, a weight the
offloader cannot swap in place). So the subclass is taken apart once after quantizing: its codes
become `weight` and its per-channel scale the buffer `scale`, and an `Int8Tensor` is put together
from them (no copy) for each matmul, on the device the input is on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modules.errors import UserError
from modules.quantization.base import QuantizedLinear
from modules.quantization.linear_fp8 import dequantize_through_float32


class QuantizationError(UserError, RuntimeError):
    pass


def _torchao_int8_weight(dense: torch.Tensor) -> torch.Tensor:
    """torchao's Int8Tensor for a dense [out, in] weight, quantized where the weight is."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    linear = nn.Linear(dense.shape[1], dense.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(dense, requires_grad=False)
    quantize_(linear, Int8WeightOnlyConfig())
    weight = linear.weight
    if type(weight) in (torch.Tensor, nn.Parameter) or not hasattr(weight, "qdata"):
        # a stub or broken torchao whose quantize_ does nothing must not pass for int8
        raise QuantizationError("torchao's quantize_ left the layer dense (is torchao a working install?)")
    if weight.zero_point is not None and bool(weight.zero_point.any()):
        # weight-only int8 is symmetric; a torchao that changed that would need the zero point stored too
        raise QuantizationError("torchao's int8 weight came with a nonzero zero point, which LinearInt8 does not store")
    return weight


class LinearInt8(QuantizedLinear):
    """State dict: `weight` (int8 codes, [out, in]), `scale` (float32, [out, 1]: one per output
    channel), `bias` (compute dtype). The dense weight is `weight * scale`."""

    mode = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__(in_features, out_features, bias, compute_dtype, device=device)
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.int8, device=device),
                                   requires_grad=False)
        self.register_buffer("scale", torch.ones(out_features, 1, dtype=torch.float32, device=device))

    @torch.no_grad()
    def quantize_weight(self, weight: torch.Tensor) -> None:
        if weight.shape != self.weight.shape:
            raise ValueError(f"weight of shape {tuple(weight.shape)} for a layer of shape {tuple(self.weight.shape)}")
        # from float32, as the other layers do: a weight first rounded to a bfloat16 compute dtype would
        # carry that rounding into the codes (about half an int8 step more error)
        quantized = _torchao_int8_weight(weight.detach().to(device=self.weight.device, dtype=torch.float32))
        self.weight.copy_(quantized.qdata)
        self.scale.copy_(quantized.scale.reshape(self.scale.shape))

    def _torchao_weight(self, device: torch.device) -> torch.Tensor:
        from torchao.quantization import Int8Tensor

        return Int8Tensor(self.weight.detach().to(device), self.scale.detach().to(device),
                          [1, self.in_features], self.compute_dtype)

    def dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._torchao_weight(x.device))

    def unquantized_weight(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        # what torchao's dequantize() computes (codes x float32 scale, rounded once), for any dtype:
        # torchao's scales are not bfloat16-exact, so the straight path would add a gain error
        return dequantize_through_float32(self.weight, self.scale, dtype, device)
