"""The declared-union seams (modules/config/tagged.py; docs/members.md): an optimizer and a training
method defined in this file only, each registered at runtime with its config, implementation and
traits, are valid config types and train the tiny model, with no other file edited. (The adapter
algorithm and weight mode seams: tests/test_adapter_seam.py, tests/test_weight_mode_seam.py.)

If a union were a table of the built-in members, or something still branched on a member's name,
`optimizer.type: toy_sign_sgd` or `method.type: toy_bias` would be unknown or refused here."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import torch
from conftest import train_config
from pydantic import Field
from safetensors.torch import load_file, save_file

from modules.config.method_configs import METHODS, MethodConfigBase, register_method_config
from modules.config.optimizer_configs import OPTIMIZERS, OptimizerConfigBase, register_optimizer_config
from modules.methods.base import TrainingMethod
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer

# --- a toy optimizer: sign SGD -------------------------------------------------------------------


class ToySignSGDConfig(OptimizerConfigBase):
    type: Literal["toy_sign_sgd"] = "toy_sign_sgd"
    lr: float = Field(1e-3, gt=0, le=1, description="Step size of each sign step.")


class ToySignSGD(torch.optim.Optimizer):
    def __init__(self, groups, lr):
        super().__init__(groups, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    parameter.add_(parameter.grad.sign(), alpha=-group["lr"])
                    self.state[parameter]["steps"] = self.state[parameter].get("steps", 0) + 1


def build_toy_sign_sgd(config: ToySignSGDConfig, groups: list[dict]) -> torch.optim.Optimizer:
    return ToySignSGD(groups, lr=config.lr)


# --- a toy training method: bias tuning (BitFit) ---------------------------------------------------


class ToyBiasConfig(MethodConfigBase):
    type: Literal["toy_bias"] = "toy_bias"


class ToyBiasMethod(TrainingMethod):
    """Trains only the biases of the trained parts; saves them as one safetensors file."""

    name = "toy_bias"
    state_prefix = "toy_bias."

    def trained_parts(self) -> list[str]:
        return [name for name, part in self.config.model.parts.items() if part.train]

    def _biases(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(f"{part}.{name}", p) for part in self.trained_parts()
                for name, p in self.family.parts[part].named_parameters() if name.endswith(".bias")]

    def setup(self) -> None:
        for _, parameter in self._biases():
            parameter.requires_grad_(True)
        self.initial = self.state_dict()  # what the test compares the trained biases with

    def parameter_groups(self, config) -> list[dict]:
        return [{"params": [p for _, p in self._biases()], "lr": config.optimizer.lr, "name": "biases"}]

    def named_parameters(self):
        return self._biases()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self._biases()}

    def load_state_dict(self, state, source: str) -> None:
        with torch.no_grad():
            for name, p in self._biases():
                p.copy_(state[name])

    def save(self, path: Path, dtype: torch.dtype, metadata: dict[str, str]) -> list[Path]:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(dtype).contiguous() for k, v in self.state_dict().items()}, str(path), metadata)
        return [path]


@pytest.fixture
def toy_members():
    register_optimizer_config(ToySignSGDConfig, build_toy_sign_sgd, unshardable="a test's optimizer")
    register_method_config(ToyBiasConfig, ToyBiasMethod)
    yield
    OPTIMIZERS.unregister("toy_sign_sgd")
    METHODS.unregister("toy_bias")


def _train(tiny_model, shape_images, tmp_path, overlay):
    config = train_config(tiny_model, shape_images, tmp_path, {"schedule": {"epochs": 1, "max_steps": 2}}, overlay)
    trainer = GenericTrainer(config, TrainCallbacks())
    try:
        trainer.start()
        trainer.train()  # the first-step guard inside checks every trained parameter got a gradient
        trainer.end()
    finally:
        trainer.release()
    return trainer, config


def test_a_runtime_optimizer_trains_an_adapter_and_declares_its_traits(toy_members, tiny_model, shape_images,
                                                                       tmp_path):
    from modules.config.errors import ConfigError
    from modules.config.loading import build_config

    trainer, config = _train(tiny_model, shape_images, tmp_path, {"optimizer": {"type": "toy_sign_sgd", "lr": 1e-2}})
    assert isinstance(trainer.optimizer, ToySignSGD) and trainer.step == 2
    assert {state["steps"] for state in trainer.optimizer.state.values()} == {2}
    assert config.output_path.exists()
    with pytest.raises(ConfigError, match=r"optimizer\.lr: must be <= 1"):  # its own bounds
        build_config([{"optimizer": {"type": "toy_sign_sgd", "lr": 2}}])
    assert OPTIMIZERS.traits("toy_sign_sgd").unshardable == "a test's optimizer"


def test_a_runtime_training_method_trains_and_saves_what_it_trains(toy_members, tiny_model, shape_images, tmp_path):
    trainer, config = _train(tiny_model, shape_images, tmp_path, {"method": {"type": "toy_bias"}})
    assert [type(m) for m in trainer.methods] == [ToyBiasMethod] and trainer.step == 2
    saved = load_file(str(config.output_path))
    assert saved and all(name.endswith(".bias") for name in saved)
    method = trainer.methods[0]
    assert any(not torch.equal(saved[name], method.initial[name]) for name in saved)  # the steps moved them
