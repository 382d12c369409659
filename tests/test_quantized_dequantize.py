"""Weight-only dequantize goes straight into the compute dtype: no float32 copy of the weight in
bfloat16 (float8 is the Flux 24 GB preset's mode; a float32 temporary is ~19 bytes of traffic a
weight per use instead of 3), and the result is still the float32 product rounded once."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from modules.quantization.linear_fp8 import LinearFp8, bfloat16_exact_ceil
from modules.quantization.linear_w8a8 import LinearW8A8Fp8
from quantized_cases import dense_linear

# the fp8-coded layers (int8 keeps exact float32 scales: its 255 levels would show a coarser step)
STRAIGHT = [LinearFp8, LinearW8A8Fp8]


class WeightSizedFloat32(TorchDispatchMode):
    """Records every op that returns a float32 tensor with `numel` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.numel() == self.numel:
                self.ops.append(str(func))
        return out


@pytest.mark.parametrize("cls", STRAIGHT, ids=lambda cls: cls.__name__)
def test_bfloat16_dequantize_makes_no_float32_copy_of_the_weight(cls):
    layer = cls.from_linear(dense_linear(bias=False), torch.bfloat16)
    with WeightSizedFloat32(layer.out_features * layer.in_features) as seen:
        weight = layer.unquantized_weight(torch.bfloat16, "cpu")
    assert weight.dtype == torch.bfloat16
    assert seen.ops == []


@pytest.mark.parametrize("cls", STRAIGHT, ids=lambda cls: cls.__name__)
def test_bfloat16_dequantize_is_the_float32_product_rounded_once(cls):
    # the quantizers store bfloat16-exact scales, so the straight path loses nothing
    layer = cls.from_linear(dense_linear(bias=False), torch.bfloat16)
    scale = layer.scale if layer.scale.dim() == 0 else layer.scale[:, None]
    through_float32 = (layer.weight.to(torch.float32) * scale).to(torch.bfloat16)
    assert torch.equal(layer.unquantized_weight(torch.bfloat16, "cpu"), through_float32)


def test_bfloat16_exact_ceil_rounds_up_onto_the_bfloat16_grid():
    torch.manual_seed(0)
    scale = torch.rand(4096) * 1e-2 + 1e-12
    ceiled = bfloat16_exact_ceil(scale)
    assert torch.equal(ceiled.to(torch.bfloat16).to(torch.float32), ceiled)  # exact in bfloat16
    assert bool((ceiled >= scale).all()) and bool((ceiled <= scale * (1 + 2 ** -7)).all())
    assert torch.equal(bfloat16_exact_ceil(ceiled), ceiled)  # already on the grid: unchanged
