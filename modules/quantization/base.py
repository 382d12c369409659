"""QuantizedLinear: the contract every quantized linear layer keeps (docs/architecture.md, "Contracts the tests pin").

- `unquantized_weight(dtype, device)` returns the dense weight on exactly that device and dtype,
  wherever the storage sits, and changes nothing stored. Adapters (DoRA, weight-decomposed LoKr)
  and merges read the base weight only through it.
- `offload_tensors()` names every tensor that travels with the layer (weight, bias, scales, quant
  state), so an offloader moves them together and never splits a weight from its scale.
- every scale is a registered buffer and is read only through `self.<name>`: no plain attribute
  aliases it, because `Module.to()` and `load_state_dict()` rebind buffers, not attributes.
- `state_dict()` loaded into a fresh layer of the same shape and options gives identical outputs.

The compute dtype is a constructor argument (from the config), never inferred from a stored
tensor: once storage is fp8 or packed uint8, "the dtype of the first parameter" means nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn


class QuantizedLinear(nn.Module, ABC):
    # the config's weight_dtype name this class implements ("float8", "nf4", ...); the mode's entry
    # in weight_modes.py says how a Linear becomes this class (its layer factory)
    mode: ClassVar[str]
    # True: the class stores a checkpoint's own per-tensor float8 codes and scale (ComfyUI's scaled
    # fp8) as they are, through `set_quantized(codes, scale)`, instead of quantizing them again
    keeps_scaled_fp8: ClassVar[bool] = False

    def __init__(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        # the bias stays dense (it is tiny); frozen like the weight
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device), requires_grad=False)
                     if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype, **options) -> QuantizedLinear:
        """A quantized copy of a dense Linear, stored on the Linear's device."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype,
                    device=linear.weight.device, **options)
        layer.quantize_weight(linear.weight.detach())
        if linear.bias is not None:
            layer.set_bias(linear.bias.detach())
        return layer

    @abstractmethod
    @torch.no_grad()
    def quantize_weight(self, weight: torch.Tensor) -> None:
        """Store `weight` (dense, any dtype and device) quantized, on this layer's storage device."""

    @torch.no_grad()
    def set_bias(self, bias: torch.Tensor) -> None:
        self.bias.data = bias.to(device=self.bias.device, dtype=self.compute_dtype)

    @abstractmethod
    def unquantized_weight(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """The dense weight on exactly `device` and `dtype`; stored tensors are not changed."""

    def offload_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor that travels with the layer, by attribute name."""
        tensors = dict(self.named_parameters(recurse=False))
        tensors.update(self.named_buffers(recurse=False))
        return {name: tensor for name, tensor in tensors.items() if tensor is not None}

    def storage_device(self) -> torch.device:
        return next(iter(self.offload_tensors().values())).device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = FrozenWeightMatmul.apply(x.to(self.compute_dtype), self, self.dense_matmul)
        if self.bias is not None:
            # added outside the Function so autograd handles it should a trainer unfreeze the bias
            out = out + self.bias.to(device=x.device, dtype=self.compute_dtype)
        return out

    def dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T without bias, `x` already in the compute dtype; no autograd (runs inside the Function).

        The weight is dequantized where the input is: with the layer parked in RAM and the input on
        the GPU, the math still runs on the GPU.
        """
        return F.linear(x, self.unquantized_weight(self.compute_dtype, x.device))

    def _apply(self, fn, recurse=True):
        # Module.half() / .float() / .to(dtype) cast every floating tensor, and fp8 counts as
        # floating: a model-wide cast would turn fp8 codes into bf16 (storage doubles) and float32
        # scales / absmax into fp16 (precision lost; bitsandbytes refuses them). Stored tensors keep
        # their dtype and only the rest of `fn` (device moves, pinning) applies; the compute dtype
        # comes from the constructor, never from the storage.
        def keep_dtype(tensor: torch.Tensor) -> torch.Tensor:
            applied = fn(tensor)
            if applied.dtype != tensor.dtype:
                # detach(): a new tensor object even without a move, as Module._apply expects
                applied = tensor.detach().to(device=applied.device)
            return applied

        return super()._apply(keep_dtype, recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, compute_dtype={self.compute_dtype}")


class FrozenWeightMatmul(torch.autograd.Function):
    """`matmul(x)` = x @ W^T for a frozen quantized W, with a gradient for `x` only.

    Plain F.linear on the dequantized weight would make autograd keep that dense weight alive until
    backward whenever `x` requires grad (adapters in earlier layers): every layer's dense copy at
    once, which undoes the quantization. Here backward dequantizes again, from whatever storage the
    layer has by then (an offloader may have moved it), in the compute dtype. The layer, not its
    tensors, is what is kept, so `.to()` / `load_state_dict()` between forward and backward are seen.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantizedLinear, matmul) -> torch.Tensor:
        ctx.layer = layer
        return matmul(x)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        layer = ctx.layer
        grad_input = None
        if ctx.needs_input_grad[0]:
            weight = layer.unquantized_weight(layer.compute_dtype, grad_output.device)
            grad_input = grad_output.to(layer.compute_dtype) @ weight
        return grad_input, None, None


def is_linear(module: nn.Module) -> bool:
    """A dense or quantized linear layer (what LoRA-style adapters attach to)."""
    return isinstance(module, (nn.Linear, QuantizedLinear))


def unquantized_weight(module: nn.Module, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The dense weight of any Linear or Conv2d, quantized or not, on `device` in `dtype`."""
    if isinstance(module, QuantizedLinear):
        return module.unquantized_weight(dtype, device)
    return module.weight.detach().to(device=device, dtype=dtype)
