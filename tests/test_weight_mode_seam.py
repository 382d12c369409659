"""The weight-mode seam: a mode defined in this file only, registered at runtime, is accepted by
the config, offered by the schema, budgeted by the policy and trained on by the real trainer,
with no other file edited (modules/quantization/weight_modes.py; docs/quantization.md, "Adding a weight mode").

The toy mode is a fake 4-bit quantization on the CPU: int8 codes limited to [-8, 7] with one
float32 scale per output channel. It keeps the QuantizedLinear contract (modules/quantization/base.py)
and nothing else: everything that reaches it does so through the registry.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import fixed_loss, train_config
from torch import nn

# imported before the toy mode is registered, as in a real run: a table copied from the registry at
# import would miss the mode, and these tests would fail
from modules.config.errors import ConfigError
from modules.config.loading import build_config
from modules.config.train_config import TrainConfig
from modules.quantization.base import QuantizedLinear, is_linear, unquantized_weight
from modules.quantization.capabilities import Capabilities, ModeSupport, mode_support, working_modes
from modules.quantization.policy import plan_base_precision
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from modules.quantization.weight_modes import LayerOptions, WeightMode, register_weight_mode, unregister_weight_mode

MODE = "toy_int4"
BYTES = 0.55  # half a byte per weight plus the scales, as the policy should budget it


class LinearToyInt4(QuantizedLinear):
    """`weight`: int8 codes in [-8, 7]; `scale`: float32 per output channel; dense = weight * scale."""

    mode = MODE

    def __init__(self, in_features, out_features, bias, compute_dtype, device=None):
        super().__init__(in_features, out_features, bias, compute_dtype, device=device)
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.int8, device=device),
                                   requires_grad=False)
        self.register_buffer("scale", torch.ones(out_features, 1, dtype=torch.float32, device=device))

    @torch.no_grad()
    def quantize_weight(self, weight):
        dense = weight.detach().to(device=self.weight.device, dtype=torch.float32)
        scale = dense.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 7
        self.weight.copy_((dense / scale).round().clamp(-8, 7).to(torch.int8))
        self.scale.copy_(scale)

    def unquantized_weight(self, dtype, device):
        return (self.weight.to(device=device, dtype=torch.float32) * self.scale.to(device)).to(dtype)


def _toy_layer(linear: nn.Linear, compute_dtype: torch.dtype, options: LayerOptions) -> QuantizedLinear:
    return LinearToyInt4(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype, device="cpu")


TOY = WeightMode(MODE, BYTES, capability=lambda caps: None, layer_factory=_toy_layer,
                 how="fake int4 codes, dequantized in forward")


@pytest.fixture
def toy_mode():
    register_weight_mode(TOY)
    yield TOY
    unregister_weight_mode(MODE)  # other tests list every registered mode


def test_the_config_and_its_schema_take_the_mode_only_while_registered(toy_mode):
    overlay = {"model": {"parts": {"unet": {"weight_dtype": MODE}}}}
    assert build_config([overlay]).model.parts["unet"].weight_dtype == MODE
    schema = TrainConfig.model_json_schema()["$defs"]["ModelPartConfig"]["properties"]["weight_dtype"]
    assert MODE in schema["enum"] and "auto" in schema["enum"]

    unregister_weight_mode(MODE)
    try:
        with pytest.raises(ConfigError, match=rf"model\.parts\.unet\.weight_dtype: unknown weight mode '{MODE}' "
                                              r"\(known: float32, .*nf4, auto\)"):
            build_config([overlay])
        schema = TrainConfig.model_json_schema()["$defs"]["ModelPartConfig"]["properties"]["weight_dtype"]
        assert MODE not in schema["enum"]
    finally:
        register_weight_mode(TOY)


def test_the_policy_budgets_the_mode_at_its_bytes_per_parameter(toy_mode):
    # a bare CPU box, described by hand (the policy is a pure function of it)
    caps = Capabilities(device="cpu", device_name="test CPU", cuda=False, compute_capability=None,
                        total_memory=2**34, free_memory=2**34, dense_dtypes=("float32", "bfloat16"),
                        float8_dtypes=False, torchao_int8=False, bitsandbytes=False, int_mm=False, scaled_mm=False)
    assert mode_support(caps)[MODE] == ModeSupport(True, None, "fake int4 codes, dequantized in forward")
    assert MODE in working_modes(caps)
    sizes = {"unet": 1_000_000, "vae": 100_000}
    plan = plan_base_precision({"unet": MODE, "vae": "float32"}, "sd15", sizes, 2**40, caps)
    assert plan.modes == {"unet": MODE, "vae": "float32"}
    assert plan.estimated_bytes == int(1_000_000 * BYTES + 100_000 * 4)
    # auto never picks a mode without an auto tier, however tight the memory
    squeezed = plan_base_precision("auto", "sd15", sizes, 1000, caps)
    assert MODE not in squeezed.modes.values()

    # the capability probe decides where it runs
    unusable = dataclasses.replace(TOY, capability=lambda caps: "toy needs a toy device")
    unregister_weight_mode(MODE)
    register_weight_mode(unusable)
    with pytest.raises(ValueError, match=rf"model\.parts\.unet\.weight_dtype: {MODE} does not work on this machine: "
                                         "toy needs a toy device"):
        plan_base_precision({"unet": MODE}, "sd15", sizes, 2**40, caps)
    unregister_weight_mode(MODE)
    register_weight_mode(TOY)


def _base_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    weights = {}
    for name, child in module.named_modules():
        if is_linear(child):
            weights[f"{name}.weight"] = unquantized_weight(child, torch.float32, "cpu").clone()
        weights.update({f"{name}.{k}": v.detach().float().clone() for k, v in child.named_parameters(recurse=False)
                        if v.dtype.is_floating_point})
    return weights


def test_a_lora_trains_on_the_mode_through_the_real_trainer(toy_mode, tmp_path, tiny_model, one_image):
    class Status(TrainCallbacks):
        def __init__(self):
            self.lines: list[str] = []

        def on_status(self, message):
            self.lines.append(message)

    config = train_config(tiny_model, one_image, tmp_path, {
        "model": {"parts": {"unet": {"weight_dtype": MODE}}},
        "schedule": {"epochs": 6, "batch_size": 1},
        "optimizer": {"lr": 1e-2},
    })
    status = Status()
    trainer = GenericTrainer(config, status)
    trainer.start()
    unet = trainer.family.parts["unet"]
    report = trainer.family.quantization_reports["unet"]
    toy_layers = [m for m in unet.modules() if isinstance(m, LinearToyInt4)]
    assert len(toy_layers) == len(report.quantized) > 10 and report.mode == MODE
    assert any(f"stored as {MODE}" in line for line in status.lines), status.lines
    assert trainer.family.compute_dtype("unet") == torch.float32  # quantized: computes in train_dtype
    on_toy = [adapter for adapter in trainer.adapters if isinstance(adapter.base, LinearToyInt4)]
    assert len(on_toy) > 10, "the adapters must sit on the toy layers"

    before_weights = _base_weights(unet)
    initial = [[p.detach().clone() for p in adapter.parameters()] for adapter in on_toy]
    before = fixed_loss(trainer, draws=4)
    trainer.train()
    after = fixed_loss(trainer, draws=4)
    assert after < before, (before, after)
    # the adapters on the toy layers got gradients through them and learned...
    learned = [adapter for adapter, start in zip(on_toy, initial)
               if all(not torch.equal(p, p0) for p, p0 in zip(adapter.parameters(), start))]
    assert len(learned) == len(on_toy), f"{len(on_toy) - len(learned)} adapters on toy layers did not learn"
    # ...and the toy layers stayed frozen, bit for bit
    assert all(not t.requires_grad for layer in toy_layers for t in layer.offload_tensors().values())
    after_weights = _base_weights(unet)
    assert all(torch.equal(before_weights[k], after_weights[k]) for k in before_weights)
