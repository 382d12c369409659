"""int8 weight-only storage through torchao (`quantize_` with `Int8WeightOnlyConfig`).

torchao swaps the Linear's weight for an int8 tensor subclass in place and keeps the module
object, so forward hooks (our adapters) survive either order of "quantize" and "attach
adapters" (tests/test_quantized_loading.py pins that). We quantize at load, before adapters
exist, so nothing ever hooks a module that is replaced later.
"""

from __future__ import annotations

from modules.errors import UserError

import torch
from torch import nn


class QuantizationError(UserError, RuntimeError):
    pass


def is_torchao_int8(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module.weight) not in (torch.Tensor, nn.Parameter)


def quantize_int8_(linear: nn.Linear) -> nn.Linear:
    """Quantize one dense Linear in place; refuse to pretend when torchao left it dense."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(linear, Int8WeightOnlyConfig())
    if not is_torchao_int8(linear):
        # a stub or broken torchao whose quantize_ does nothing must not pass for int8
        raise QuantizationError("torchao's quantize_ left the layer dense (is torchao a working install?)")
    linear.weight.requires_grad_(False)
    return linear
