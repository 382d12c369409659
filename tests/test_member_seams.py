"""The declared seams (modules/config/tagged.py, modules/quantization/weight_modes.py; docs/members.md):
a toy optimizer, training method, adapter algorithm and weight mode, each defined and registered in
this file only (its config, implementation and traits), are valid config types and train the tiny
model, with no other file edited.

If a union or the weight-mode registry were a table of the built-in members, or something still
branched on a member's name, `optimizer.type: toy_sign_sgd`, `method.type: toy_bias`,
`adapter.type: toy_ia3` or `weight_dtype: toy_int4` would be unknown or refused here. Every test
registers its toy through a fixture and removes it after: other tests list every registered member."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal

import pytest
import torch
from conftest import fixed_loss, train_config
from pydantic import Field
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

# imported before any toy registers, as in a real run: a table copied from a registry at import
# would miss the toys, and these tests would fail
from modules.adapters.base import AdapterModule
from modules.config.adapter_configs import AdapterConfigBase
from modules.config.errors import ConfigError
from modules.config.loading import build_config
from modules.config.method_configs import METHODS, MethodConfigBase, register_method_config
from modules.config.optimizer_configs import OPTIMIZERS, OptimizerConfigBase, register_optimizer_config
from modules.config.train_config import TrainConfig
from modules.methods.base import TrainingMethod
from modules.quantization.base import QuantizedLinear, is_linear, unquantized_weight
from modules.quantization.capabilities import Capabilities, ModeSupport, mode_support, working_modes
from modules.quantization.policy import plan_base_precision
from modules.quantization.weight_modes import LayerOptions, WeightMode, register_weight_mode, unregister_weight_mode
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


# --- a toy adapter algorithm: an IA3-like learned scale per output channel (as peft's IA3) -------
# configured by `adapter.type` with its own option; trains (its tensors get gradients, the loss
# moves), saves a file with its own key names and kohya metadata, and loads back

ADAPTER = "toy_ia3"


class ToyIA3Config(AdapterConfigBase):
    type: Literal["toy_ia3"] = Field(ADAPTER, description="toy_ia3: a learned scale per output channel.")
    initial: float = Field(0.0, ge=-1, description="The scale's start (0: the layer unchanged).")


class ToyIA3Module(AdapterModule):
    """y = b + (1 + s) * (W x): one learned scale per output channel, the bias left as it is."""

    algorithm = ADAPTER
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
    unregister_adapter(ADAPTER)


def test_a_runtime_algorithm_is_a_config_type_with_its_own_options(toy_algorithm):
    adapter = build_config([{"adapter": {"rank": 8}}, {"adapter": {"type": ADAPTER, "initial": 0.5}}]).adapter
    assert isinstance(adapter, ToyIA3Config) and adapter.initial == 0.5  # lora's rank below is not its option
    assert ADAPTER in json.dumps(TrainConfig.model_json_schema())  # what the GUI and `launch.py schema` read
    with pytest.raises(ConfigError, match=r"adapter\.initial: must be >= -1"):
        build_config([{"adapter": {"type": ADAPTER, "initial": -2}}])


def test_the_gui_menu_lists_each_algorithm_under_the_label_it_declares(toy_algorithm):
    """The top bar's training-method menu comes from the declarations (label, dora_label), never a
    name table in ui: a runtime algorithm shows under its `type`, a declared label replaces it."""
    from modules.adapters.registry import register_adapter, unregister_adapter
    from ui.app import training_methods

    methods = training_methods()
    assert methods["LoRA"] == ("lora", False) and methods["DoRA"] == ("lora", True)
    assert methods["LoHa"] == ("loha", False) and methods[ADAPTER] == (ADAPTER, False)
    unregister_adapter(ADAPTER)
    register_adapter(ToyIA3Module, label="Toy (IA3)", dora_label="Toy + DoRA")
    methods = training_methods()
    assert methods["Toy (IA3)"] == (ADAPTER, False) and methods["Toy + DoRA"] == (ADAPTER, True)
    assert ADAPTER not in methods


def test_a_runtime_algorithm_trains_saves_and_loads_back(toy_algorithm, tmp_path, tiny_model, shape_images):
    from modules.adapters.formats.files import load_adapter_file

    config = train_config(tiny_model, shape_images, tmp_path, {
        "adapter": {"type": ADAPTER, "layer_preset": "attn"}, "schedule": {"max_steps": 2}, "optimizer": {"lr": 5e-2}})
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
    assert json.loads(metadata["ss_network_args"]) == {"algo": ADAPTER}  # the base class's kohya metadata
    with torch.no_grad():
        for parameter in trainer.adapters.parameters():
            parameter.zero_()
    load_adapter_file(path, trainer.adapters, trainer.family)
    loaded = trainer.adapters.state_dict()
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)


def test_an_unregistered_algorithm_is_an_unknown_type():
    from modules.adapters.registry import adapter_classes

    assert ADAPTER not in adapter_classes()
    with pytest.raises(ConfigError, match=rf"adapter.type: unknown type '{ADAPTER}'"):
        build_config([{"adapter": {"type": ADAPTER}}])


# --- a toy weight mode: fake 4-bit on the CPU -----------------------------------------------------
# int8 codes limited to [-8, 7] with one float32 scale per output channel. It keeps the
# QuantizedLinear contract (modules/quantization/base.py) and nothing else: the config, the
# schema, the policy and the trainer reach it through the registry only.

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
