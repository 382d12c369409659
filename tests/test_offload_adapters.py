"""Every adapter type on the quantized modes, built after the conductor parked half the UNet:
adapters are created on the train device and read parked base weights through
`unquantized_weight(.., train_device)`, so nothing is built from a half-moved layer.

Each adapter that reads its base layer meets every mode: DoRA and weight-decomposed LoKr read the
base weight (at build and in each forward), OFT the base's bias in its forward, and plain LoRA stands
for what every adapter shares (its geometry and hook on the quantized layer, AdapterModule). LoHa
and plain LoKr read nothing of the base but that shared part, so each meets one mode, of different
layer kinds (nf4's QuantizedLinear, torchao's int8 tensor)."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config

from modules.quantization.replace import QUANTIZED_MODES
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer

ADAPTERS = {
    "lora": {"type": "lora"},
    "dora": {"type": "lora", "dora": True},
    "loha": {"type": "loha"},
    "lokr": {"type": "lokr"},
    "lokr-wd": {"type": "lokr", "dora": True},
    "oft": {"type": "oft", "block_size": 8},
}


EVERY_MODE = ("dora", "lokr-wd", "lora", "oft")
ONE_MODE = {"loha": "nf4", "lokr": "int8"}  # they read only the shared geometry and hook
CASES = [(adapter, mode) for adapter in EVERY_MODE for mode in QUANTIZED_MODES] + sorted(ONE_MODE.items())


def test_every_adapter_type_and_every_mode_is_covered():
    assert set(EVERY_MODE) | set(ONE_MODE) == set(ADAPTERS)
    assert set(ONE_MODE.values()) <= set(QUANTIZED_MODES)


@pytest.mark.parametrize("adapter, mode", CASES)
def test_an_adapter_type_trains_on_a_quantized_mode_with_offloading(adapter, mode, fake_device, tmp_path,
                                                                      quick_tiny_model, one_image):
    config = train_config(quick_tiny_model, one_image, tmp_path, {
        "model": {"parts": {"unet": {"weight_dtype": mode, "gradient_checkpointing": True, "offload_fraction": 0.5}}},
        "adapter": {**ADAPTERS[adapter], "layer_preset": "attn"},
        "schedule": {"epochs": 1, "batch_size": 1},  # one step: the first-step guard checks every adapter learns
        "optimizer": {"lr": 1e-3},
        "train_device": str(fake_device),
    })
    trainer = GenericTrainer(config, TrainCallbacks())
    trainer.start()
    assert trainer.conductors["unet"].parked and trainer.conductors["unet"].kit is not None  # CUDA's path
    initial = {k: v.cpu().clone() for k, v in trainer.adapters.state_dict().items()}
    assert all(p.device.type == fake_device.type for p in trainer.adapters.parameters())
    trainer.train()  # the first-step guard raises if any adapter parameter did not learn
    assert trainer.step == 1 and torch.isfinite(torch.tensor(trainer.last_loss))
    changed = [k for k, v in trainer.adapters.state_dict().items() if not torch.equal(v.cpu(), initial[k])]
    assert changed
