"""Training a LoRA on quantized base weights: it learns, the base never changes, and the trainer
resolves, refuses and gates modes as the policy says."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_loss, train_config

from modules.config.errors import ConfigError
from modules.quantization.base import is_linear, unquantized_weight
from modules.quantization.capabilities import detect_capabilities
from modules.quantization.replace import QUANTIZED_MODES
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer


class Log(TrainCallbacks):
    def __init__(self):
        self.status: list[str] = []
        self.warnings: list[str] = []

    def on_status(self, message):
        self.status.append(message)

    def on_warning(self, message):
        self.warnings.append(message)


def base_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every base weight as a dense float32 copy, read through the quantized layers' own contract."""
    weights = {}
    for name, child in module.named_modules():
        if is_linear(child):
            weights[f"{name}.weight"] = unquantized_weight(child, torch.float32, "cpu").clone()
        else:
            weights.update({f"{name}.{k}": v.detach().float().clone() for k, v in child.named_parameters(recurse=False)})
    return weights


@pytest.mark.parametrize("mode", QUANTIZED_MODES)
def test_lora_learns_on_each_quantized_mode_and_the_base_never_changes(mode, tmp_path, tiny_model, one_image):
    config = train_config(tiny_model, one_image, tmp_path, {
        "model": {"parts": {"unet": {"weight_dtype": mode}}},
        "schedule": {"epochs": 16, "batch_size": 1},
        "optimizer": {"lr": 1e-2},  # attention + MLP adapters only: they sit on the quantized layers
    })
    log = Log()
    trainer = GenericTrainer(config, log)
    trainer.start()
    assert any(f"stored as {mode}" in line for line in log.status), log.status
    unet = trainer.family.parts["unet"]
    before_weights = base_weights(unet)
    initial_adapter = {k: v.clone() for k, v in trainer.adapters.state_dict().items()}
    before = fixed_loss(trainer)
    trainer.train()
    after = fixed_loss(trainer)
    assert after < before * 0.9, (mode, before, after)
    after_weights = base_weights(unet)
    assert all(torch.equal(before_weights[k], after_weights[k]) for k in before_weights)
    changed = [k for k, v in trainer.adapters.state_dict().items() if not torch.equal(v, initial_adapter[k])]
    assert any(k.endswith("lora_up.weight") for k in changed)


def test_auto_resolves_before_loading_and_says_what_it_chose(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path, {"model": {"parts": {"unet": {"weight_dtype": "auto"}}}})
    log = Log()
    trainer = GenericTrainer(config, log)
    trainer.start()
    # the tiny model fits any machine many times over: dense bfloat16
    assert trainer.family.weight_modes["unet"] == "bfloat16"
    assert any(s.startswith("base weights: ") and "unet bfloat16" in s for s in log.status)
    assert trainer.family.parts["unet"].conv_in.weight.dtype == torch.bfloat16


def test_a_mode_this_machine_cannot_run_is_refused_naming_the_part(tmp_path, tiny_model, shape_images, monkeypatch):
    from dataclasses import replace

    import modules.trainer.weight_modes as weight_modes

    without_torchao = replace(detect_capabilities("cpu"), torchao_int8=False)
    monkeypatch.setattr(weight_modes, "detect_capabilities", lambda device: without_torchao)
    config = train_config(tiny_model, shape_images, tmp_path, {"model": {"parts": {"unet": {"weight_dtype": "int8"}}}})
    with pytest.raises(ConfigError, match=r"model\.parts\.unet\.weight_dtype: int8 does not work on this machine.*torchao"):
        GenericTrainer(config, Log()).start()


def test_compile_is_turned_off_with_the_reason_where_the_mode_does_not_trace(tmp_path, tiny_model, shape_images,
                                                                              monkeypatch):
    import modules.trainer.part_setup as part_setup

    monkeypatch.setattr(part_setup, "compile_blocker",
                        lambda mode, device, dtype: f"{mode} weights: 1 graph break(s): opaque kernel" if mode == "nf4" else None)
    config = train_config(tiny_model, shape_images, tmp_path,
                          {"compile": True, "model": {"parts": {"unet": {"weight_dtype": "nf4"}}}})
    log = Log()
    trainer = GenericTrainer(config, log)
    trainer.start()
    assert "compile: off for model.parts.unet (nf4 weights: 1 graph break(s): opaque kernel)" in log.warnings
    assert all(m._compiled_call_impl is None for m in trainer.family.parts["unet"].modules())


def test_compile_is_applied_where_the_mode_traces(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path,
                          {"compile": True, "model": {"parts": {"unet": {"weight_dtype": "float8"}}}})
    log = Log()
    trainer = GenericTrainer(config, log)
    trainer.start()
    assert not log.warnings
    # regional compile: each repeated block (tests/test_compile.py)
    assert all(block._compiled_call_impl is not None for block in trainer.family.checkpoint_blocks("unet"))


@pytest.mark.parametrize("mode", ["float8", "nf4", "w8a8_int8"])
def test_training_on_a_second_device_keeps_every_tensor_there(mode, fake_device, tmp_path, quick_tiny_model, one_image):
    # The fake device raises on any op that mixes its tensors with CPU ones, as CUDA does: a scale
    # left behind by a move, or an adapter created where a weight was parked, fails here.
    config = train_config(quick_tiny_model, one_image, tmp_path, {
        "model": {"parts": {"unet": {"weight_dtype": mode}}},
        "schedule": {"epochs": 3, "batch_size": 1},
        "train_device": str(fake_device),
    })
    trainer = GenericTrainer(config, Log())
    trainer.start()
    assert trainer.family.quantize_device == trainer.device  # quantized there at load (test_quantize_on_device.py)
    unet = trainer.family.parts["unet"]
    before_weights = base_weights(unet)
    trainer.train()
    stored = [t for m in unet.modules() for t in (m.offload_tensors().values() if hasattr(m, "offload_tensors")
                                                   else [*m.parameters(recurse=False), *m.buffers(recurse=False)])]
    assert all(t.device.type == fake_device.type for t in stored)
    assert all(p.device.type == fake_device.type for p in trainer.adapters.parameters())
    assert trainer.step == 3 and torch.isfinite(torch.tensor(trainer.last_loss))
    after_weights = base_weights(unet)
    assert all(torch.equal(before_weights[k].cpu(), after_weights[k].cpu()) for k in before_weights)
