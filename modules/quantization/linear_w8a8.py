"""LinearW8A8: 8-bit weight and 8-bit activations (weight_dtype "w8a8_int8" / "w8a8_fp8").

The weight is stored int8 or float8_e4m3fn with one float32 scale per output channel. At forward the
activations are quantized per token (per row of the flattened input) to the same format, and the
product runs on an 8-bit kernel where one exists:

- int8: `torch._int_mm` (int8 x int8 -> int32). It runs on CPU for any shape; on CUDA it needs more
  than 16 rows and both matrix dims a multiple of 8.
- fp8: `torch._scaled_mm` with row-wise scales, on CUDA with compute capability >= 8.9 and dims a
  multiple of 16. Row-wise scaling came later than fp8 itself and some builds take only bf16/fp16
  output with it (RTX 40xx/50xx raise ValueError for float32), so the kernel is probed once per
  device and compute dtype with exactly this call (`fp8_output_dtype`): a float32 compute dtype
  computes in bfloat16 there and the result is cast back; a device that refuses both falls back.

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
from modules.quantization.linear_fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    bfloat16_exact_ceil,
    dequantize_through_float32,
    scaled_dequantize,
)

logger = logging.getLogger(__name__)

# False forces the dequantize-then-F.linear fallback everywhere (tests compare the two; debugging)
USE_KERNELS = True

WEIGHT_FORMATS = {"int8": torch.int8, "fp8": FP8_DTYPE}
INT8_MAX = 127.0

# (device as a string, compute dtype) -> the output dtype torch._scaled_mm's row-wise kernel gives
# there for that compute dtype, or None where it refuses: probed once, not on every call
_FP8_OUTPUT_DTYPE: dict[tuple[str, torch.dtype], torch.dtype | None] = {}
# what torch._scaled_mm raises where it does not run (ValueError: a refused output dtype)
_KERNEL_ERRORS = (RuntimeError, ValueError, TypeError, NotImplementedError, AttributeError)


def quantize_rows(x: torch.Tensor, weight_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of a 2-D tensor: (codes, float32 scale per row)."""
    dense = x.to(torch.float32)
    qmax = INT8_MAX if weight_format == "int8" else FP8_MAX
    amax = dense.abs().amax(dim=1)
    # an all-zero row has no range to map; any positive scale reproduces it
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    if weight_format == "fp8":
        # bfloat16-exact: the weight dequantizes straight into bfloat16 without a float32 copy
        # (linear_fp8.bfloat16_exact_ceil); int8 keeps the exact scale (its 255 levels would show
        # the up to 2^-8 coarser step) and dequantizes through float32
        scale = bfloat16_exact_ceil(scale)
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
    """Whether torch._scaled_mm may take an (m, k) x (k, n) product on `device` (device and shape;
    `fp8_output_dtype` says whether this build really runs it)."""
    return fp8_kernel_device(device) and m > 0 and k % 16 == 0 and n % 16 == 0


def fp8_kernel_device(device: torch.device) -> bool:
    """A device with fp8 tensor cores: CUDA with compute capability >= 8.9."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


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


def rowwise_scaled_mm_runs(device: torch.device, out_dtype: torch.dtype) -> bool:
    """One tiny fp8_matmul, row-wise scales as the layer passes them, giving `out_dtype`."""
    try:
        a = torch.ones(32, 64, device=device).to(FP8_DTYPE)
        b = torch.ones(32, 64, device=device).to(FP8_DTYPE)
        scale = torch.full((32,), 0.5, device=device)
        out = fp8_matmul(a, scale, b, scale, out_dtype)
        return out.dtype == out_dtype and float(out[0, 0].item()) == 16.0  # 64 x 0.5 x 0.5
    except _KERNEL_ERRORS:
        return False


def fp8_output_dtype(device: torch.device, compute_dtype: torch.dtype) -> torch.dtype | None:
    """The output dtype the fp8 kernel computes in on `device` for `compute_dtype` (itself, or
    bfloat16 where float32 output is refused), None where the kernel does not run; probed once."""
    key = (str(device), compute_dtype)
    if key not in _FP8_OUTPUT_DTYPE:
        candidates = [compute_dtype] + ([torch.bfloat16] if compute_dtype == torch.float32 else [])
        _FP8_OUTPUT_DTYPE[key] = next((dtype for dtype in candidates if rowwise_scaled_mm_runs(device, dtype)),
                                      None)
        if _FP8_OUTPUT_DTYPE[key] not in (None, compute_dtype):
            logger.info("torch._scaled_mm takes no %s output with row-wise scales on %s: fp8 W8A8 computes in "
                        "%s there and casts back", compute_dtype, device, _FP8_OUTPUT_DTYPE[key])
    return _FP8_OUTPUT_DTYPE[key]


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
        # the path the last eager forward took ("int_mm", "scaled_mm", "dense") and the dtype the
        # kernel computed in: what a test or a benchmark asks to know the fast kernel really ran
        self.last_kernel: str | None = None
        self.last_kernel_dtype: torch.dtype | None = None

    @torch.no_grad()
    def quantize_weight(self, weight: torch.Tensor) -> None:
        if weight.shape != self.weight.shape:
            raise ValueError(f"weight of shape {tuple(weight.shape)} for a layer of shape {tuple(self.weight.shape)}")
        codes, scale = quantize_rows(weight.detach().to(self.weight.device), self.weight_format)
        self.weight.copy_(codes)
        self.scale.copy_(scale)

    def unquantized_weight(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        dequantize = scaled_dequantize if self.weight_format == "fp8" else dequantize_through_float32
        return dequantize(self.weight, self.scale[:, None], dtype, device)

    def _apply(self, fn, recurse=True):
        moved = super()._apply(fn, recurse)
        device = self.weight.device
        eager = not torch.compiler.is_compiling()
        if self.weight_format == "fp8" and USE_KERNELS and eager and fp8_kernel_device(device):
            # probe the kernel now, eagerly, so a compiled forward finds the answer cached: a probe
            # traced inside torch.compile would break the graph (it reads a result back)
            fp8_output_dtype(device, self.compute_dtype)
        return moved

    def kernel_path(self, x2d: torch.Tensor) -> str:
        """"int_mm", "scaled_mm" or "dense" for a flattened (tokens, in_features) input."""
        if not USE_KERNELS:
            return "dense"
        m, k = x2d.shape
        if self.weight_format == "int8":
            return "int_mm" if int8_kernel_runs(x2d.device, m, k, self.out_features) else "dense"
        if fp8_kernel_runs(x2d.device, m, k, self.out_features) and fp8_output_dtype(
                x2d.device, self.compute_dtype) is not None:
            return "scaled_mm"
        return "dense"

    def _record(self, path: str, dtype: torch.dtype) -> None:
        if not torch.compiler.is_compiling():  # an attribute write inside a traced graph is a side effect
            self.last_kernel, self.last_kernel_dtype = path, dtype

    def quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T without bias, `x` in the compute dtype; no autograd (runs inside the Function)."""
        x2d = x.reshape(-1, self.in_features)
        path = self.kernel_path(x2d)
        if path == "dense":
            self._record("dense", self.compute_dtype)
            return self.dense_matmul(x)
        # the weight follows the input (layer parked in RAM, input on the GPU), as in the fallback
        w_codes = self.weight.to(x.device)
        w_scale = self.scale.to(x.device)
        x_codes, x_scale = quantize_rows(x2d, self.weight_format)
        if path == "int_mm":
            out_dtype = self.compute_dtype
            out = int8_matmul(x_codes, x_scale, w_codes, w_scale, out_dtype)
        else:
            out_dtype = fp8_output_dtype(x.device, self.compute_dtype)
            try:
                out = fp8_matmul(x_codes, x_scale, w_codes, w_scale, out_dtype).to(self.compute_dtype)
            except _KERNEL_ERRORS as error:
                # the probe passed but this shape did not: not retried on this device and dtype
                _FP8_OUTPUT_DTYPE[(str(x.device), self.compute_dtype)] = None
                logger.warning("torch._scaled_mm refused on %s (%s); fp8 W8A8 falls back to "
                               "dequantize + F.linear there", x.device, error)
                self._record("dense", self.compute_dtype)
                return self.dense_matmul(x)
        self._record(path, out_dtype)
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
