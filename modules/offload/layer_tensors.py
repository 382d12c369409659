"""The tensors of a block's layers, and moving them without replacing Parameters.

A move swaps `tensor.data`, so the Parameter objects autograd, hooks and any optimizer hold stay
the same objects (Module.to() keeps them too; a fresh Parameter would silently detach anything
holding the old one). Tensor subclasses that cannot swap their data (torchao's int8 weight) are
rebound instead; they are frozen base weights that nothing else holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from modules.quantization.base import QuantizedLinear


@dataclass
class LayerTensor:
    module: nn.Module
    name: str

    def get(self) -> torch.Tensor:
        return getattr(self.module, self.name)

    def put(self, value: torch.Tensor) -> None:
        current = self.get()
        if type(current) in (torch.Tensor, nn.Parameter) and type(value) is torch.Tensor:
            current.data = value
        elif self.name in self.module._parameters:
            self.module._parameters[self.name] = nn.Parameter(value, requires_grad=False)
        else:
            self.module._buffers[self.name] = value


def layer_tensors(block: nn.Module) -> Iterator[LayerTensor]:
    """Every tensor of every layer in `block`: for quantized layers exactly `offload_tensors()`
    (weight, bias, scale and quant state together), for others their parameters and buffers."""
    for module in block.modules():
        if isinstance(module, QuantizedLinear):
            names = list(module.offload_tensors())
        else:
            names = [n for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
                     if t is not None]
        for name in names:
            yield LayerTensor(module, name)


def tensor_bytes(tensor: torch.Tensor) -> int:
    parts = [getattr(tensor, n) for n in getattr(tensor, "tensor_data_names", [])]  # torchao subclasses
    return sum(t.numel() * t.element_size() for t in parts) if parts else tensor.numel() * tensor.element_size()


def block_bytes(block: nn.Module) -> int:
    """The bytes of `block`'s tensors, a tensor two layers share (tied weights) once."""
    unique = {id(tensor): tensor for tensor in (t.get() for t in layer_tensors(block))}
    return sum(tensor_bytes(tensor) for tensor in unique.values())
