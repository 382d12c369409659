"""Every adapter type on every quantized mode, built after the conductor parked half the UNet:
adapters are created on the train device and read parked base weights through
`unquantized_weight(.., train_device)`, so nothing is built from a half-moved layer."""

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


@pytest.mark.parametrize("mode", QUANTIZED_MODES)
@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_every_adapter_type_trains_on_every_quantized_mode_with_offloading(adapter, mode, fake_device, tmp_path,
                                                                           tiny_model, one_image):
    config = train_config(tiny_model, one_image, tmp_path, {
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
