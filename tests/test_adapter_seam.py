"""The adapter seam: an algorithm defined in this file only (an IA3-like per-channel scale, as
peft's IA3 scales a layer's output), registered at runtime, is configured by `adapter.type` with its
own option, trains on the tiny model (its tensors get gradients, the loss moves), saves a file with
its own key names and kohya metadata, and loads back, with no edit to any other file.

If the registry or the config union were a table of the built-in algorithms instead of being built
from the registered classes, `adapter.type: toy_ia3` would be unknown here and every test would fail.
"""

from __future__ import annotations

import json
from typing import Literal

import pytest
import torch
from conftest import fixed_loss, train_config
from pydantic import Field
from safetensors import safe_open
from torch import nn

from modules.adapters.base import AdapterModule
from modules.config.adapter_configs import AdapterConfigBase

TYPE = "toy_ia3"


class ToyIA3Config(AdapterConfigBase):
    type: Literal["toy_ia3"] = Field(TYPE, description="toy_ia3: a learned scale per output channel.")
    initial: float = Field(0.0, ge=-1, description="The scale's start (0: the layer unchanged).")


class ToyIA3Module(AdapterModule):
    """y = b + (1 + s) * (W x): one learned scale per output channel, the bias left as it is."""

    algorithm = TYPE
    config_class = ToyIA3Config
    key_names = ("ia3_scale",)

    def __init__(self, name, base, initial, dropout=0.0, rank_dropout=0.0, module_dropout=0.0,
                 device="cpu", dtype=torch.float32):
        super().__init__(name, base, dropout=dropout, rank_dropout=rank_dropout, module_dropout=module_dropout)
        self.ia3_scale = nn.Parameter(torch.full((self.out_dim,), float(initial), device=device, dtype=dtype))

    @classmethod
    def from_config(cls, config, part, name, module, device, dtype, output_format="kohya"):
        return cls(name, module, config.initial, **cls.common_options(config, device, dtype))

    def _channels(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(1, -1, 1, 1) if self.is_conv else tensor

    def adapt(self, module, x, output, training):
        bias = self.bias_of(module, output)
        core = output if bias is None else output - bias
        return output + core * self._channels(self.ia3_scale).to(output.dtype)

    def delta_weight(self, training=False):
        return self.base_weight() * self.ia3_scale.float().view(-1, *[1] * (len(self.weight_shape) - 1))


@pytest.fixture
def toy_algorithm():
    from modules.adapters.registry import register_adapter, unregister_adapter

    register_adapter(ToyIA3Module)
    yield ToyIA3Module
    unregister_adapter(TYPE)


def test_a_runtime_algorithm_is_a_config_type_with_its_own_options(toy_algorithm):
    from modules.config.errors import ConfigError
    from modules.config.loading import build_config
    from modules.config.train_config import TrainConfig

    adapter = build_config([{"adapter": {"rank": 8}}, {"adapter": {"type": TYPE, "initial": 0.5}}]).adapter
    assert isinstance(adapter, ToyIA3Config) and adapter.initial == 0.5  # lora's rank below is not its option
    assert TYPE in json.dumps(TrainConfig.model_json_schema())  # what the GUI and `launch.py schema` read
    with pytest.raises(ConfigError, match=r"adapter\.initial: must be >= -1"):
        build_config([{"adapter": {"type": TYPE, "initial": -2}}])


def test_a_runtime_algorithm_trains_saves_and_loads_back(toy_algorithm, tmp_path, tiny_model, shape_images):
    from modules.adapters.formats.files import load_adapter_file
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_model, shape_images, tmp_path, {
        "adapter": {"type": TYPE, "layer_preset": "attn"}, "schedule": {"max_steps": 2}, "optimizer": {"lr": 5e-2}})
    trainer = GenericTrainer(config)
    trainer.start()
    adapters = list(trainer.adapters)
    assert adapters and all(isinstance(a, ToyIA3Module) for a in adapters)
    loss_before = fixed_loss(trainer, draws=4)
    trainer.train()  # the first-step guard inside checks that every adapter got a gradient
    assert trainer.step == 2
    assert all(a.ia3_scale.abs().sum() > 0 for a in adapters), "a scale never moved"
    assert fixed_loss(trainer, draws=4) != loss_before
    trained = {k: v.clone() for k, v in trainer.adapters.state_dict().items()}
    path = trainer.end()

    with safe_open(str(path), "pt") as file:
        keys, metadata = list(file.keys()), file.metadata()
    assert keys and all(key.endswith(".ia3_scale") for key in keys)  # the class's own key names
    assert json.loads(metadata["ss_network_args"]) == {"algo": TYPE}  # the base class's kohya metadata
    with torch.no_grad():
        for parameter in trainer.adapters.parameters():
            parameter.zero_()
    load_adapter_file(path, trainer.adapters, trainer.family)
    loaded = trainer.adapters.state_dict()
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)


def test_an_unregistered_algorithm_is_an_unknown_type():
    from modules.adapters.registry import adapter_classes
    from modules.config.errors import ConfigError
    from modules.config.loading import build_config

    assert TYPE not in adapter_classes()
    with pytest.raises(ConfigError, match=rf"adapter.type: unknown type '{TYPE}'"):
        build_config([{"adapter": {"type": TYPE}}])
