"""W8A8's kernel path with the layer parked away from its input (the conductor's case on CUDA):
weight codes and scale follow the input to its device. Run on the fake device with the kernel
path forced, since CUDA's guard does not take the fake device."""

from __future__ import annotations

import torch

import modules.quantization.linear_w8a8 as w8a8
from modules.quantization.linear_w8a8 import LinearW8A8Int8
from quantized_cases import IN, dense_linear, make_input


def test_the_kernel_path_brings_the_weight_and_its_scale_to_the_inputs_device(fake_device, monkeypatch):
    layer = LinearW8A8Int8.from_linear(dense_linear(bias=False), torch.float32)  # parked: on the CPU
    x = make_input()
    on_cpu = layer(x)
    monkeypatch.setattr(w8a8, "int8_kernel_runs", lambda device, m, k, n: m > 0)
    assert layer.kernel_path(x.reshape(-1, IN).to(fake_device)) == "int_mm"
    with torch.no_grad():
        moved = layer(x.to(fake_device))
    assert moved.device.type == fake_device.type and layer.scale.device.type == "cpu"
    torch.testing.assert_close(moved.cpu(), on_cpu, rtol=1e-6, atol=1e-6)
