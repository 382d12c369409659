"""Guards that used to survive their own deletion, each pinned by a test that fails without it:
the first-step guard's "did not change at all" branch; compute dtypes from the config, never from a
parameter (a quantized part's is train_dtype); the lifecycle order (train device before adapters);
no block deep-copied per forward; the mallopt call of the streamed load.
(Compile and SDPA: tests/test_compile.py, tests/test_sdpa.py.)"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import train_config
from torch import nn

import modules.methods.adapter as adapter_method
from modules.adapters.layer_selection import module_kinds, select_layers
from modules.adapters.registry import create_adapter
from modules.config.train_config import AdapterConfig
from modules.config.families import family_names, get_family_class
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from modules.trainer.guards import TrainingError, check_first_step, snapshot

ROOT = Path(__file__).resolve().parents[1]


# --- the first-step guard: a module whose every gradient is zero ------------------------------------


def test_a_module_with_gradients_that_are_all_zero_is_named_as_not_changing():
    """Its tensors all got a gradient and none was non-zero, so the per-tensor checks pass; only the
    per-module check sees that the adapter cannot learn (its layer's output never reaches the loss)."""
    torch.manual_seed(0)
    live, dead = nn.Linear(8, 8), nn.Linear(8, 8)
    config = AdapterConfig(rank=2, alpha=2)
    adapters = nn.ModuleDict({name: create_adapter(config, "unet", name, layer, torch.device("cpu"), torch.float32)
                              for name, layer in (("lora_live", live), ("lora_dead", dead))})
    for adapter in adapters.values():
        adapter.hook()
    named = list(adapters.named_parameters())
    before = snapshot(named)
    optimizer = torch.optim.Adam([p for _, p in named], lr=1e-2)  # no weight decay: a zero gradient moves nothing
    x = torch.randn(4, 8)
    (live(x).square().mean() + 0.0 * dead(x).sum()).backward()
    optimizer.step()
    assert all(p.grad is not None for _, p in named)
    with pytest.raises(TrainingError, match=r"1 module\(s\) did not change at all: lora_dead$"):
        check_first_step(named, before)
    check_first_step([(n, p) for n, p in named if n.startswith("lora_live.")], before)  # the live one learns


# --- compute dtypes come from the config, never from a parameter ------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tiny_family_model) -> dict[str, Path]:
    return {name: tiny_family_model(name) for name in family_names()}  # the session's, built once


@pytest.mark.parametrize("family_name", family_names())
def test_no_family_takes_a_compute_dtype_from_a_parameter(family_name, tiny_models, one_image, tmp_path, monkeypatch):
    """Each part gets a float64 first parameter (quantized storage makes the first parameter fp8 or
    uint8 in real runs; float64 is a dtype nothing computes in): a family that casts inputs to a
    part's `.dtype` or `next(parameters()).dtype` sends float64 into a layer, which is caught here."""
    family_class = get_family_class(family_name)
    real_load = family_class.load
    float64_inputs: list[str] = []

    def load_with_a_decoy_first_parameter(family):
        real_load(family)
        for part_name, part in family.parts.items():
            own = dict(part._parameters)  # the decoy goes before any parameter the root has itself
            part._parameters.clear()
            part.register_parameter("decoy_first_parameter",
                                    nn.Parameter(torch.zeros(1, dtype=torch.float64), requires_grad=False))
            part._parameters.update(own)
            assert next(part.parameters()).dtype == torch.float64
            for name, module in part.named_modules():
                if name and next(module.parameters(recurse=False), None) is not None:
                    module.register_forward_pre_hook(
                        lambda m, args, kwargs, where=f"{part_name}.{name}": float64_inputs.extend(
                            [where] if any(torch.is_tensor(v) and v.dtype == torch.float64
                                           for v in [*args, *kwargs.values()]) else []),
                        with_kwargs=True)

    monkeypatch.setattr(family_class, "load", load_with_a_decoy_first_parameter)
    config = train_config(tiny_models[family_name], one_image, tmp_path,
                          {"model": {"family": family_name}, "schedule": {"max_steps": 1, "batch_size": 1}})
    trainer = GenericTrainer(config, TrainCallbacks())
    trainer.start()  # encodes images and captions
    trainer.train()  # predicts and steps
    assert trainer.step == 1
    assert not float64_inputs, f"float64 reached {sorted(set(float64_inputs))[:5]}"
    for part in trainer.family.parts:
        assert trainer.family.compute_dtype(part) == torch.float32, part


def test_a_quantized_part_computes_in_train_dtype_not_float32(tiny_model, tmp_path):
    """A quantized part has no dense dtype of its own: it computes in train_dtype (bf16 here).
    Falling back to float32 instead would train at twice the activation memory, silently."""
    from modules.quantization.base import QuantizedLinear

    config = train_config(tiny_model, tmp_path, tmp_path, {
        "model": {"parts": {"unet": {"weight_dtype": "w8a8_int8"}}}, "train_dtype": "bfloat16"})
    family = get_family_class("sd15")(config)
    family.load()
    assert family.compute_dtype("unet") == torch.bfloat16 and family.compute_dtype("vae") == torch.float32
    layers = [m for m in family.parts["unet"].modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) > 10 and {layer.compute_dtype for layer in layers} == {torch.bfloat16}
    assert layers[0](torch.randn(2, layers[0].in_features)).dtype == torch.bfloat16


# --- the lifecycle: parts on the train device before the adapters are built -------------------------


def test_adapters_are_built_after_the_parts_reach_the_train_device(fake_device, tiny_model, one_image, tmp_path,
                                                                   monkeypatch):
    """docs/architecture.md, lifecycle 4-5: the conductor has parked half the UNet and the rest is on the train
    device when the adapters are built; each adapter is on the train device, parked layer or not."""
    seen: dict[str, str] = {}
    real_build = adapter_method.build_adapter_set

    def recording_build(family, adapter, trained_parts, device, *args, **kwargs):
        for part in trained_parts:
            modules = dict(family.parts[part].named_modules())
            for name in select_layers(family, part, module_kinds(family.parts[part]), adapter).chosen:
                seen[f"{part}.{name}"] = modules[name].weight.device.type
        return real_build(family, adapter, trained_parts, device, *args, **kwargs)

    monkeypatch.setattr(adapter_method, "build_adapter_set", recording_build)
    config = train_config(tiny_model, one_image, tmp_path, {
        "model": {"parts": {"unet": {"gradient_checkpointing": True, "offload_fraction": 0.5}}},
        "adapter": {"type": "lora", "dora": True},  # DoRA reads its base weight when it is built
        "schedule": {"max_steps": 1, "batch_size": 1}, "train_device": str(fake_device)})
    trainer = GenericTrainer(config, TrainCallbacks())
    trainer.start()
    assert trainer.conductors["unet"].parked
    assert set(seen.values()) == {"cpu", fake_device.type}, seen  # some parked, the rest already moved
    assert all(p.device.type == fake_device.type for p in trainer.adapters.parameters())
    trainer.train()
    assert trainer.step == 1


# --- no block is deep-copied on a forward ------------------------------------------------------------


def test_a_training_step_deep_copies_no_module(tiny_model, one_image, tmp_path, monkeypatch):
    """A wrapper that runs a copy of its block per forward trains the copy (issue 4) and costs a block's
    memory per call; checkpointing and offloading must run the blocks themselves."""
    trainer = GenericTrainer(train_config(tiny_model, one_image, tmp_path, {
        "model": {"parts": {"unet": {"gradient_checkpointing": True}}},
        "schedule": {"epochs": 2, "batch_size": 1}}), TrainCallbacks())
    trainer.start()
    copied: list[str] = []

    def refuse(module, memo):
        copied.append(type(module).__name__)
        raise AssertionError(f"{type(module).__name__} deep-copied during training")

    monkeypatch.setattr(nn.Module, "__deepcopy__", refuse, raising=False)
    monkeypatch.setattr(nn.Parameter, "__deepcopy__", refuse)
    trainer.train()
    assert trainer.step == 2 and not copied
    with pytest.raises(AssertionError, match="deep-copied"):  # the trap itself works
        copy.deepcopy(nn.Linear(2, 2))


# --- the streamed load returns freed memory to the OS -------------------------------------------------

_RETAINED = """
import json, pathlib, sys
sys.path.insert(0, {root!r})
import torch
from modules.util.memory import process_memory


def measure():
    # glibc serves blocks under its mmap threshold from the heap; freed there, they stay resident
    big = torch.ones((24 << 20) // 4)  # freeing it raises glibc's dynamic threshold to 24 MiB
    del big
    base = process_memory()["rss"]
    blocks = [torch.ones((2 << 20) // 4) for _ in range(40)]
    peak = process_memory()["rss"]
    del blocks[:-1]
    print(json.dumps((process_memory()["rss"] - base) / (peak - base)))


if {load!r}:
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    import modules.loading.streamed_load as streamed_load

    # measured while the load runs (its first weight read): the setting is for the load only,
    # training afterwards reuses freed memory (issue 19, tests/test_step_work.py)
    read_weight = streamed_load._read_weight
    def measuring_read(*args, **kwargs):
        if not measured:
            measured.append(measure())
        return read_weight(*args, **kwargs)
    measured = []
    streamed_load._read_weight = measuring_read
    save_file(torch.nn.Linear(64, 64).state_dict(), {folder!r} + "/model.safetensors")
    with init_empty_weights():
        empty = torch.nn.Linear(64, 64)
    streamed_load.load_streamed(empty, pathlib.Path({folder!r}), part="toy", where="model.parts.toy",
                                mode="float32", compute_dtype=torch.float32)
    assert measured, "the load read no weight"
else:
    measure()
"""


def _retained_after_free(folder: Path, load: bool) -> float:
    """Share of 80 MB of freed 2 MiB blocks still resident, in a fresh process (glibc state is per
    process), during a streamed load or without one."""
    script = _RETAINED.format(root=str(ROOT), folder=str(folder), load=load)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc/self")
def test_during_a_streamed_load_freed_blocks_go_back_to_the_os(tmp_path):
    """Freed blocks stay resident in a process that loads nothing (so the measurement can see it),
    and go back to the OS while a streamed load runs, because the load fixes glibc's mmap threshold."""
    without_load = _retained_after_free(tmp_path, load=False)
    during_load = _retained_after_free(tmp_path, load=True)
    assert without_load > 0.8, without_load
    assert during_load < 0.2, during_load
