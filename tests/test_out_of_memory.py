"""An out-of-memory error in training becomes one message: what was asked, what was free, and the
config fields that lower the train device's peak, with their values (modules/trainer/out_of_memory.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import train_config

CUDA_TEXT = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.70 GiB of which "
             "1.25 GiB is free. Including non-PyTorch memory, this process has 14.44 GiB memory in use.")


def test_an_out_of_memory_step_is_one_message_naming_what_to_change(tiny_model, shape_images, tmp_path, monkeypatch):
    from launch import user_error
    from modules.cli.train_command import run_training
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer
    from modules.trainer.out_of_memory import OutOfMemory

    def step_out_of_memory(*_args, **_kwargs):
        raise torch.OutOfMemoryError(CUDA_TEXT)

    monkeypatch.setattr(GenericTrainer, "_forward", step_out_of_memory)
    config = train_config(tiny_model, shape_images, tmp_path, {"schedule": {"max_steps": 1}})
    with pytest.raises(OutOfMemory) as caught:
        run_training(config, TrainCallbacks())
    message = str(caught.value)
    assert user_error(caught.value) is caught.value  # launch.py shows it as one `error` line/event
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert message.startswith("out of memory on cpu in training step 1: asked for 2.00 GiB, 1.25 GiB was free "
                              "of 15.70 GiB")
    for field in ("model.parts.unet.offload_fraction (now 0.0)", "model.parts.unet.gradient_checkpointing (now false)",
                  "model.parts.unet.weight_dtype (now float32)", "schedule.batch_size (now 2)",
                  "data.resolution (now 64)", "train_dtype (now float32)"):
        assert field in message
    assert "model.parts.vae" not in message  # no blocks to offload, nothing quantized


def test_the_message_names_only_fields_that_can_still_change(tiny_model, shape_images, tmp_path):
    from modules.trainer.out_of_memory import fitting_fields

    config = train_config(tiny_model, shape_images, tmp_path, {
        "model": {"parts": {"unet": {"offload_fraction": 1.0, "gradient_checkpointing": True, "weight_dtype": "nf4"}}},
        "schedule": {"batch_size": 1}, "train_dtype": "bfloat16"})
    text = "\n".join(fitting_fields(config))
    assert "unet.offload_fraction" not in text and "unet.gradient_checkpointing" not in text
    assert "unet.weight_dtype" not in text and "schedule.batch_size" not in text and "train_dtype" not in text
    assert "data.resolution (now 64)" in text


@pytest.mark.cuda
def test_a_real_cuda_out_of_memory_error_is_read():
    """torch's own CUDA message (its wording on the torch this runs) still gives what was asked and free."""
    import re
    from types import SimpleNamespace

    from modules.config.loading import build_config
    from modules.trainer.out_of_memory import out_of_memory_error

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    device = torch.device("cuda", 0)
    _, total = torch.cuda.mem_get_info(device)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        torch.empty(total * 2, dtype=torch.uint8, device=device)
    trainer = SimpleNamespace(device=device, config=build_config([{}]), step=0, dataset=object(), family=None)
    message = str(out_of_memory_error(caught.value, trainer))
    assert re.search(r"in training step 1: asked for [\d.]+ [KMGTP]?i?B, [\d.]+ [KMGTP]?i?B was free of ", message), message
