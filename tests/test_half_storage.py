"""weight_dtype float16 under train_dtype bfloat16 (and the reverse) trains: the part is stored and
computes in the train dtype, and the run says so (modules/quantization/half_storage.py). Kept in
float16, SDXL's UNet failed its first step on the CPU in torch.cat of its float16 text embedding and
its bfloat16 time embedding ("Unexpected floating ScalarType in at::autocast::prioritize")."""

from __future__ import annotations

import torch

from conftest import train_config
from modules.quantization.half_storage import part_compute_dtype, stored_dtype


def test_only_the_other_16_bit_float_computes_and_is_stored_in_the_train_dtype():
    assert part_compute_dtype("float16", torch.bfloat16) == torch.bfloat16
    assert part_compute_dtype("bfloat16", torch.float16) == torch.float16
    assert part_compute_dtype("float16", torch.float32) == torch.float16  # no autocast: as stored
    assert part_compute_dtype("float32", torch.bfloat16) == torch.float32  # autocast casts down from float32
    assert part_compute_dtype("nf4", torch.bfloat16) == torch.bfloat16
    assert stored_dtype("float16", torch.bfloat16) == torch.bfloat16
    assert stored_dtype("float16", torch.float16) == torch.float16


def test_an_sdxl_unet_stored_in_float16_trains_under_bfloat16(tiny_family_model, shape_images, tmp_path):
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer

    class Warnings(TrainCallbacks):
        def __init__(self):
            self.said = []

        def on_warning(self, message):
            self.said.append(message)

    callbacks = Warnings()
    config = train_config(tiny_family_model("sdxl"), shape_images, tmp_path, {
        "model": {"family": "sdxl", "parts": {"unet": {"weight_dtype": "float16"}}},
        "train_dtype": "bfloat16", "schedule": {"epochs": 1, "max_steps": 1, "batch_size": 1}})
    trainer = GenericTrainer(config, callbacks)
    try:
        trainer.start()
        trainer.train()
        assert trainer.last_loss == trainer.last_loss  # finite, one step made
        assert {p.dtype for p in trainer.family.parts["unet"].parameters() if p.is_floating_point()} <= {
            torch.bfloat16, torch.float32}
    finally:
        trainer.release()
    assert any(line.startswith("model.parts.unet.weight_dtype: float16 under train_dtype bfloat16: stored in "
                               "bfloat16") for line in callbacks.said), callbacks.said
