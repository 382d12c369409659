"""Quantized layers are quantized on the train device at load, one layer at a time: the CPU takes
100-400 ns a parameter (tens of minutes for a FLUX.1 transformer in nf4), a GPU milliseconds a
layer. The device never holds more than one layer's dense weight beyond its plan: a part that
stays there keeps its quantized layers there, a part that will be parked sends each back."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from accelerate import init_empty_weights
from safetensors.torch import save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from modules.loading.streamed_load import load_streamed
from modules.quantization.base import QuantizedLinear
from modules.quantization.linear_fp8 import LinearFp8
from modules.quantization.linear_w8a8 import LinearW8A8Int8

WIDTH, LAYERS = 64, 4


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))


@pytest.fixture(scope="module")
def stack_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stack")
    torch.manual_seed(0)
    save_file(Stack().state_dict(), str(folder / "model.safetensors"))
    return folder


class DenseWeightsOn(TorchDispatchMode):
    """Keeps a weak reference to every floating tensor of a layer weight's size made on `device`,
    so a test can count how many are alive at any moment."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type, self.made = device_type, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(tensor, torch.Tensor) and tensor.device.type == self.device_type
                    and tensor.dtype.is_floating_point and tensor.dtype.itemsize >= 2
                    and tensor.numel() == WIDTH * WIDTH):
                self.made.append(weakref.ref(tensor))
        return out

    def alive(self) -> int:
        gc.collect(1)  # young generations: the fake device's CPU fallback leaves reference cycles to its temporaries
        return sum(ref() is not None for ref in self.made)


@pytest.mark.parametrize("cls, mode, stays", [(LinearFp8, "float8", True), (LinearW8A8Int8, "w8a8_int8", False)],
                         ids=["float8, the part stays on the device", "w8a8_int8, the part will be parked"])
def test_each_layer_is_quantized_on_the_train_device_one_at_a_time(cls, mode, stays, stack_folder, fake_device,
                                                                    monkeypatch):
    home = fake_device if stays else torch.device("cpu")
    seen, model = [], None
    real_quantize = cls.quantize_weight

    def quantize_weight(layer, weight):
        others_on_device = sum(other.storage_device().type == fake_device.type
                               for other in model.modules() if isinstance(other, QuantizedLinear) and other is not layer)
        seen.append((layer.weight.device.type, weight.device.type, tracker.alive(), others_on_device))
        real_quantize(layer, weight)

    monkeypatch.setattr(cls, "quantize_weight", quantize_weight)
    with init_empty_weights():
        model = Stack()
    with DenseWeightsOn(fake_device.type) as tracker:
        model, report = load_streamed(model, stack_folder, part="stack", where="model.parts.stack", mode=mode,
                                      compute_dtype=torch.bfloat16, quantize_device=fake_device,
                                      quantized_home=home)
    assert len(report.quantized) == LAYERS and len(seen) == LAYERS
    for layer_device, weight_device, dense_alive, others in seen:
        assert (layer_device, weight_device) == (fake_device.type, fake_device.type)  # quantized there
        assert dense_alive <= 1  # the incoming weight only: no earlier layer's dense copy lives on
        # a part that stays has its (empty) layers there from the start; a parked part's go back
        assert others == (LAYERS - 1 if stays else 0)
    assert tracker.alive() == 0  # no dense weight left on the device once loaded
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert all(layer.storage_device().type == home.type for layer in layers)
    assert model.norm.weight.device.type == "cpu"  # everything else loads onto the CPU, as before
    # the result is what quantizing on the CPU gives
    with init_empty_weights():
        on_cpu = Stack()
    on_cpu, _ = load_streamed(on_cpu, stack_folder, part="stack", where="model.parts.stack", mode=mode,
                              compute_dtype=torch.bfloat16)
    for ours, reference in zip(layers, [m for m in on_cpu.modules() if isinstance(m, QuantizedLinear)]):
        assert torch.equal(ours.weight.cpu(), reference.weight) and torch.equal(ours.scale.cpu(), reference.scale)


def test_the_train_device_is_where_layers_are_quantized_and_a_parked_part_goes_home(fake_device, tiny_model,
                                                                                    one_image, tmp_path):
    from types import SimpleNamespace

    from conftest import train_config

    from modules.model.sd15 import SD15Family
    from modules.trainer.weight_modes import quantize_device

    assert quantize_device(SimpleNamespace(device=torch.device("cpu"))) is None  # nothing to gain there
    assert quantize_device(SimpleNamespace(device=fake_device)) == fake_device  # any accelerator, not just cuda
    for fraction, home in ((0, fake_device), (0.5, torch.device("cpu")), ("auto", torch.device("cpu"))):
        config = train_config(tiny_model, one_image, tmp_path, {
            "model": {"parts": {"unet": {"weight_dtype": "float8", "offload_fraction": fraction,
                                      "gradient_checkpointing": True}}}})
        family = SD15Family(config)
        assert family.quantized_home("unet") is None  # no quantize device: stored on the CPU as before
        family.quantize_device = fake_device
        assert family.quantized_home("unet") == home
