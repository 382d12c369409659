"""Weight decomposition (DoRA): W' = m * (W + dW) / ||W + dW||, for LoRA (DoRA) and LoKr.

`dora_scale` is the magnitude m, a trainable Parameter initialised from the norm of the base
weight, read through `unquantized_weight` on the train device. Its shape says the axis, as in
LyCORIS files (ComfyUI and Forge tell the two apart by it):
  output axis (peft, LyCORIS `wd_on_out`): one norm per output row, shape (out, 1[, 1, 1]);
  input axis (OneTrainer's default, early LyCORIS): one per input column, shape (1, in[, 1, 1]).
The norm is detached from the graph, as peft does after section 4.3 of the DoRA paper: it saves
the memory of back-propagating through a full-weight norm at little cost in quality.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

Axis = Literal["output", "input"]
# guards a zero row or column; the same epsilon ComfyUI adds when it merges a DoRA file
_EPS = torch.finfo(torch.float32).eps


def weight_norm(weight: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Norm per output row or per input column, kept in the dora_scale layout."""
    ones = [1] * (weight.dim() - 2)
    if axis == "output":
        return weight.flatten(1).norm(dim=1).view(weight.shape[0], 1, *ones)
    return weight.transpose(0, 1).flatten(1).norm(dim=1).view(1, weight.shape[1], *ones)


def dora_scale_shape(weight_shape: tuple[int, ...], axis: Axis) -> tuple[int, ...]:
    ones = [1] * (len(weight_shape) - 2)
    return (weight_shape[0], 1, *ones) if axis == "output" else (1, weight_shape[1], *ones)


def init_magnitude(adapter, axis: Axis, device, dtype: torch.dtype) -> nn.Parameter:
    """m = ||W|| of the base weight (the adapter's delta is zero at init, so W' = W)."""
    with torch.no_grad():
        base = adapter.base_weight(torch.device(device))
        return nn.Parameter(weight_norm(base, axis).to(dtype))


class WeightDecomposed:
    """Mixin for an AdapterModule with `dora_scale` and `dora_axis`; call `setup_decomposition`
    in __init__ and route `adapt` through `decomposed_output`."""

    dora_axis: Axis | None = None

    def setup_decomposition(self, axis: Axis, device, dtype: torch.dtype) -> None:
        self.dora_axis = axis
        self.dora_scale = init_magnitude(self, axis, device, dtype)

    def decomposed_output(self, module: nn.Module, x: torch.Tensor, output: torch.Tensor,
                          delta_out: torch.Tensor | None, training: bool) -> torch.Tensor:
        """The decomposed layer's output. `delta_out` is the additive method's own output (its
        dropouts applied); the input axis rebuilds the weight instead and does not need it."""
        base = self.base_weight(x.device, module)
        bias = self.bias_of(module, output)
        if self.dora_axis == "output":
            with torch.no_grad():
                norm = weight_norm(base + self.delta_weight().float(), "output") + _EPS
            scale = (self.dora_scale.float() / norm).flatten()  # one factor per output channel
            scale = scale.view(1, -1, 1, 1) if self.is_conv else scale
            core = output if bias is None else output - bias
            core = core + delta_out.to(core.dtype)
            result = core * scale.to(core.dtype)
            return result if bias is None else result + bias
        # input axis: the factor scales the input columns, so the weight is rebuilt
        merged = base + self.delta_weight(training).float()
        with torch.no_grad():
            norm = weight_norm(merged, "input") + _EPS
        weight = merged * (self.dora_scale.float() / norm)
        out = self.op(x.to(weight.dtype), weight)
        out = out.to(output.dtype)
        return out if bias is None else out + bias

    def decomposed_weight(self) -> torch.Tensor:
        with torch.no_grad():
            merged = self.base_weight() + self.delta_weight().float()
            return merged * (self.dora_scale.float() / (weight_norm(merged, self.dora_axis) + _EPS))
