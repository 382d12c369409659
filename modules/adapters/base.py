"""AdapterModule: the small base every adapter algorithm (LoRA, and later LoHa, LoKr, OFT) builds on.

An adapter hooks the real base module's forward with a forward hook: no copy, no wrapper in the
module tree, so the tensors that get gradients are exactly the ones the optimizer holds, and
whatever later moves or casts the base module (offloading, quantization) acts on the real thing.
The base module is held outside the adapter's own module tree so that the adapter's state dict
holds only adapter tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class AdapterModule(nn.Module, ABC):
    def __init__(self, name: str, base: nn.Module, dropout: float = 0.0):
        super().__init__()
        self.name = name  # the key stem in saved files (lora_unet_...)
        self._base = [base]  # a list, so nn.Module does not register it as a child
        self.dropout = dropout
        self._handle = None

    @property
    def base(self) -> nn.Module:
        return self._base[0]

    @property
    def hooked(self) -> bool:
        return self._handle is not None

    def hook(self) -> None:
        if self._handle is None:
            self._handle = self.base.register_forward_hook(self._forward_hook)

    def unhook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _forward_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        # dropout follows the base module's train/eval mode (the model's, not the adapter's)
        delta = self.delta(args[0], training=module.training)
        return output + delta.to(output.dtype)

    @abstractmethod
    def delta(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        """What the adapter adds to the base module's output for input x."""

    def extra_repr(self) -> str:
        return f"{self.name}, hooked={self.hooked}"
