"""AdapterModule: the small base every adapter algorithm (LoRA/DoRA, LoHa, LoKr, OFT) builds on.

An adapter hooks the real base module's forward with a forward hook: no copy, no wrapper in the
module tree, so the tensors that get gradients are exactly the ones the optimizer holds, and
whatever later moves or casts the base module (offloading, quantization) acts on the real thing.
The base module is held outside the adapter's own module tree so that the adapter's state dict
holds only adapter tensors, under the names kohya/LyCORIS files use.

The hook is an object that survives `copy.deepcopy` as itself: a wrapper that deep-copies a block
every forward (to cast it, say) copies the block's hooks too, and a hook that were a bound method
would copy the adapter with it, so the copy would learn and the optimizer's tensors never would.

Geometry comes from `in_features`/`out_features` (or the Conv2d attributes), never from
`weight.shape` (a packed 4-bit weight has another shape), and the base weight is read only through
`unquantized_weight`, so every adapter works on dense, torchao-int8 and QuantizedLinear layers.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from modules.quantization.base import is_linear, unquantized_weight


class InertAdapter(ValueError):
    """The layer's shape leaves this algorithm nothing to learn (an OFT layout of 1-wide blocks):
    the layer is left without an adapter, and the run says so."""


class _AdapterHook:
    """The forward hook of one adapter; deep copies of the hooked module share it (see above)."""

    def __init__(self, adapter: AdapterModule):
        self.adapter = adapter

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self.adapter._forward_hook(module, args, output)

    def __deepcopy__(self, memo: dict) -> _AdapterHook:
        return self


class AdapterModule(nn.Module, ABC):
    # what kohya/LyCORIS metadata and our error messages call this algorithm
    algorithm: str = ""

    def __init__(self, name: str, base: nn.Module, dropout: float = 0.0, rank_dropout: float = 0.0,
                 module_dropout: float = 0.0):
        super().__init__()
        self.name = name  # the key stem in kohya files (lora_unet_...)
        self._base = [base]  # a list, so nn.Module does not register it as a child
        self.dropout = dropout
        self.rank_dropout = rank_dropout
        self.module_dropout = module_dropout
        self._handle = None
        # module dropout starts after the adapter's first training forward, so the first optimizer
        # step sees every adapter connected (the trainer's guard checks exactly that step)
        self._trained_once = False
        if is_linear(base):
            self.is_conv = False
            self.in_dim, self.out_dim, self.kernel_size = base.in_features, base.out_features, ()
        elif isinstance(base, nn.Conv2d):
            if base.groups != 1:
                raise TypeError(f"{name}: grouped convolutions (groups={base.groups}) take no adapter")
            self.is_conv = True
            self.in_dim, self.out_dim, self.kernel_size = base.in_channels, base.out_channels, tuple(base.kernel_size)
        else:
            raise TypeError(f"{name}: adapters support Linear and Conv2d layers, not {type(base).__name__}")

    # --- geometry ----------------------------------------------------------------------------

    @property
    def base(self) -> nn.Module:
        return self._base[0]

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """The base weight's logical (dense) shape."""
        return (self.out_dim, self.in_dim, *self.kernel_size)

    @property
    def fan_in(self) -> int:
        return self.in_dim * math.prod(self.kernel_size)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def base_weight(self, device: torch.device | None = None, module: nn.Module | None = None) -> torch.Tensor:
        """The base layer's dense weight in float32 on `device` (the adapter's by default)."""
        return unquantized_weight(module if module is not None else self.base, torch.float32,
                                  device if device is not None else self.device)

    def op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The base layer's operation with another weight (same stride, padding, dilation)."""
        if not self.is_conv:
            return F.linear(x, weight, bias)
        base = self.base
        return F.conv2d(x, weight, bias, base.stride, base.padding, base.dilation)

    def bias_of(self, module: nn.Module, like: torch.Tensor) -> torch.Tensor | None:
        """The module's bias shaped to broadcast over `like` (an output of the module)."""
        bias = getattr(module, "bias", None)
        if bias is None:
            return None
        bias = bias.detach().to(device=like.device, dtype=like.dtype)
        return bias.view(1, -1, 1, 1) if self.is_conv else bias

    # --- hooking -----------------------------------------------------------------------------

    @property
    def hooked(self) -> bool:
        return self._handle is not None

    def hook(self) -> None:
        if self._handle is None:
            self._handle = self.base.register_forward_hook(_AdapterHook(self))

    def unhook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _forward_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        # dropouts follow the base module's train/eval mode (the model's, not the adapter's)
        training = module.training
        if training:
            # torch.rand on the CPU generator: no device sync, and reproducible under the run's seed
            if self.module_dropout and self._trained_once and float(torch.rand(())) < self.module_dropout:
                return output
            self._trained_once = True
        return self.adapt(module, args[0], output, training)

    def adapt(self, module: nn.Module, x: torch.Tensor, output: torch.Tensor, training: bool) -> torch.Tensor:
        """The adapted output of `module` for input x, given its own output. Additive by default."""
        return output + self.delta(x, training).to(output.dtype)

    def delta(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        """What the adapter adds to the base output (the additive methods). By default the delta
        weight applied with the base layer's operation."""
        weight = self.delta_weight(training)
        out = self.op(x.to(weight.dtype), weight)
        if self.dropout and training:
            out = F.dropout(out, self.dropout)
        return out

    # --- weights -----------------------------------------------------------------------------

    @abstractmethod
    def delta_weight(self, training: bool = False) -> torch.Tensor:
        """The change to the base weight, in the base weight's logical shape, in the adapter dtype."""

    def merged_weight(self) -> torch.Tensor:
        """The dense float32 weight that, put into a plain copy of the base layer, gives the hooked
        output (without dropouts). On the adapter's device."""
        with torch.no_grad():
            return self.base_weight() + self.delta_weight().float()

    def row_dropout(self, weight: torch.Tensor, training: bool) -> torch.Tensor:
        """Rank dropout of the weight-based methods (LoHa, LoKr): drop whole output rows of the delta
        weight, rescaled so its expected value stays the same (as kohya does for LoRA's ranks)."""
        if not (self.rank_dropout and training):
            return weight
        keep = (torch.rand(weight.shape[0], device=weight.device) >= self.rank_dropout).to(weight.dtype)
        keep = keep / (1 - self.rank_dropout)
        return weight * keep.view(-1, *[1] * (weight.dim() - 1))

    def extra_repr(self) -> str:
        return f"{self.name}, hooked={self.hooked}"
