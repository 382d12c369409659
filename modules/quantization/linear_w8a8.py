"""LinearW8A8: 8-bit weight and 8-bit activations (weight_dtype "w8a8_int8" / "w8a8_fp8").

The weight is stored int8 or float8_e4m3fn with one float32 scale per output channel. At forward the
activations are quantized per token (per row of the flattened input) to the same format, and the
product runs on an 8-bit kernel where one exists:

- int8: `torch._int_mm` (int8 x int8 -> int32). It runs on CPU for any shape; on CUDA it needs more
  than 16 rows and both matrix dims a multiple of 8.
- fp8: `torch._scaled_mm` with row-wise scales, on CUDA with compute capability >= 8.9 and dims a
  multiple of 16. A GPU/torch build that still refuses (row-wise scaling came later than fp8 itself)
  is remembered and falls back from then on.

Everywhere else (other devices, small or odd shapes, `USE_KERNELS = False`) the weight is dequantized
and F.linear runs on the unquantized activations: slower, and slightly more exact than the kernel.

The layer is frozen, but adapters in earlier layers train through it, so the input gets a gradient:
grad_input = grad_output @ dequantized weight, computed in backward (FrozenWeightMatmul) rather than
kept from forward.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
from torch import nn

from modules.quantization.base import FrozenWeightMatmul, QuantizedLinear
from modules.quantization.linear_fp8 import FP8_DTYPE, FP8_MAX, scaled_dequantize

logger = logging.getLogger(__name__)

# False forces the dequantize-then-F.linear fallback everywhere (tests compare the two; debugging)
USE_KERNELS = True

WEIGHT_FORMATS = {"int8": torch.int8, "fp8": FP8_DTYPE}
INT8_MAX = 127.0

# devices (as strings, "cuda:0") where torch._scaled_mm raised once: not retried on every call
_FP8_KERNEL_REFUSED: set[str] = set()


def quantize_rows(x: torch.Tensor, weight_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of a 2-D tensor: (codes, float32 scale per row)."""
    dense = x.to(torch.float32)
    qmax = INT8_MAX if weight_format == "int8" else FP8_MAX
    amax = dense.abs().amax(dim=1)
    # an all-zero row has no range to map; any positive scale reproduces it
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    scaled = dense / scale[:, None]
    if weight_format == "int8":
        codes = scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        # clamp: float8_e4m3fn has no inf, an out-of-range cast would give NaN
        codes = scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def int8_kernel_runs(device: torch.device, m: int, k: int, n: int) -> bool:
    """Whether torch._int_mm takes an (m, k) x (k, n) product on `device`."""
    if device.type == "cpu":
        return m > 0
    if device.type == "cuda":
        return m > 16 and k % 8 == 0 and n % 8 == 0
    return False


def fp8_kernel_runs(device: torch.device, m: int, k: int, n: int) -> bool:
    """Whether to try torch._scaled_mm for an (m, k) x (k, n) product on `device`."""
    if device.type != "cuda" or str(device) in _FP8_KERNEL_REFUSED:
        return False
    if torch.cuda.get_device_capability(device) < (8, 9):
        return False
    return m > 0 and k % 16 == 0 and n % 16 == 0


def int8_matmul(x_codes: torch.Tensor, x_scale: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """(x_codes * x_scale[:, None]) @ (w_codes * w_scale[:, None])^T via torch._int_mm."""
    # w_codes.t() is a column-major view: the layout cuBLAS wants; a contiguous copy is much slower
    accumulated = torch._int_mm(x_codes, w_codes.t())
    return (accumulated.to(torch.float32) * x_scale[:, None] * w_scale[None, :]).to(out_dtype)


def fp8_matmul(x_codes: torch.Tensor, x_scale: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """(x_codes * x_scale[:, None]) @ (w_codes * w_scale[:, None])^T via torch._scaled_mm (row-wise scales)."""
    return torch._scaled_mm(x_codes, w_codes.t(), scale_a=x_scale[:, None].contiguous(),
                            scale_b=w_scale[None, :].contiguous(), out_dtype=out_dtype)


class LinearW8A8(QuantizedLinear):
    """State dict: `weight` (int8 or float8_e4m3fn, [out, in]), `scale` (float32, [out]), `bias`.

    Option `weight_format`: "int8" or "fp8". The subclasses LinearW8A8Int8 / LinearW8A8Fp8 fix it,
    one class per config mode.
    """

    mode = "w8a8_int8"
    default_weight_format: ClassVar[str] = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype,
                 device: torch.device | str | None = None, weight_format: str | None = None):
        super().__init__(in_features, out_features, bias, compute_dtype, device=device)
        weight_format = weight_format or self.default_weight_format
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {sorted(WEIGHT_FORMATS)}, got {weight_format!r}")
        if type(self) is not LinearW8A8 and weight_format != self.default_weight_format:
            raise ValueError(f"{type(self).__name__} stores {self.default_weight_format}, not {weight_format}")
        self.weight_format = weight_format
        # the generic class serves both modes; per instance, so the mode matches the storage
        self.mode = f"w8a8_{weight_format}"
        self.weight = nn.Parameter(
            torch.zeros(out_features, in_features, dtype=WEIGHT_FORMATS[weight_format], device=device),
            requires_grad=False)
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32, device=device))

    @torch.no_grad()
    def quantize_weight(self, weight: torch.Tensor) -> None:
        if weight.shape != self.weight.shape:
            raise ValueError(f"weight of shape {tuple(weight.shape)} for a layer of shape {tuple(self.weight.shape)}")
        codes, scale = quantize_rows(weight.detach().to(self.weight.device), self.weight_format)
        self.weight.copy_(codes)
        self.scale.copy_(scale)

    def unquantized_weight(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        return scaled_dequantize(self.weight, self.scale[:, None], dtype, device)

    def kernel_path(self, x2d: torch.Tensor) -> str:
        """"int_mm", "scaled_mm" or "dense" for a flattened (tokens, in_features) input."""
        if not USE_KERNELS:
            return "dense"
        m, k = x2d.shape
        if self.weight_format == "int8":
            return "int_mm" if int8_kernel_runs(x2d.device, m, k, self.out_features) else "dense"
        return "scaled_mm" if fp8_kernel_runs(x2d.device, m, k, self.out_features) else "dense"

    def quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T without bias, `x` in the compute dtype; no autograd (runs inside the Function)."""
        x2d = x.reshape(-1, self.in_features)
        path = self.kernel_path(x2d)
        if path == "dense":
            return self.dense_matmul(x)
        # the weight follows the input (layer parked in RAM, input on the GPU), as in the fallback
        w_codes = self.weight.to(x.device)
        w_scale = self.scale.to(x.device)
        x_codes, x_scale = quantize_rows(x2d, self.weight_format)
        if path == "int_mm":
            out = int8_matmul(x_codes, x_scale, w_codes, w_scale, self.compute_dtype)
        else:
            try:
                out = fp8_matmul(x_codes, x_scale, w_codes, w_scale, self.compute_dtype)
            except RuntimeError as error:
                _FP8_KERNEL_REFUSED.add(str(x.device))
                logger.warning("torch._scaled_mm refused on %s (%s); fp8 W8A8 falls back to "
                               "dequantize + F.linear there", x.device, error)
                return self.dense_matmul(x)
        return out.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = FrozenWeightMatmul.apply(x.to(self.compute_dtype), self, self.quantized_matmul)
        if self.bias is not None:
            out = out + self.bias.to(device=x.device, dtype=self.compute_dtype)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight_format={self.weight_format}"


class LinearW8A8Int8(LinearW8A8):
    mode = "w8a8_int8"
    default_weight_format = "int8"


class LinearW8A8Fp8(LinearW8A8):
    mode = "w8a8_fp8"
    default_weight_format = "fp8"
