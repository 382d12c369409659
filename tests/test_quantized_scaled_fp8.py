"""fp8 checkpoints that are already quantized (ComfyUI scaled fp8) load into LinearFp8 with their scale."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modules.quantization.linear_fp8 import LinearFp8
from quantized_cases import IN, OUT, make_input, raw_bytes


def scaled_fp8_checkpoint(seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    codes = (torch.randn(OUT, IN) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, torch.tensor(0.0123)


@pytest.mark.parametrize("scale_shape", [(), (1,)])
def test_scaled_fp8_weights_keep_their_scale(scale_shape):
    codes, scale = scaled_fp8_checkpoint()
    bias = torch.randn(OUT)
    layer = LinearFp8.from_quantized(codes, scale.reshape(scale_shape), bias, torch.float32)
    assert torch.equal(raw_bytes(layer.weight), raw_bytes(codes))  # stored bit for bit
    assert layer.scale.item() == scale.item() and layer.scale.shape == ()
    expected = codes.float() * scale
    assert torch.equal(layer.unquantized_weight(torch.float32, "cpu"), expected)
    x = make_input()
    torch.testing.assert_close(layer(x), F.linear(x, expected, bias))


def test_scaled_fp8_with_a_per_channel_scale_is_requantized_with_it():
    codes, _ = scaled_fp8_checkpoint()
    scale = torch.linspace(0.001, 0.05, OUT)[:, None]
    layer = LinearFp8(IN, OUT, False, torch.float32)
    layer.set_quantized(codes, scale)
    expected = codes.float() * scale
    error = (layer.unquantized_weight(torch.float32, "cpu") - expected).abs()
    assert (error <= expected.abs() / 16 + layer.scale * 2 ** -9 + 1e-7).all()
