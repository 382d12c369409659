"""The first-step guard against the failure of issue 4: a block wrapper that, in every forward,
casts a deep copy of its block from fp16 storage to fp32 compute, with the adapter injected
inside. Injected the naive way (a hook that is a bound method, deep-copied with the block and so
copying the adapter) the copy learns and the real adapter never does: the guard must stop that.
Our hooks survive the copy as themselves, so the real adapter learns."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import train_config
from torch import nn

from modules.adapters.base import AdapterModule
from modules.adapters.registry import create_adapter
from modules.config.train_config import AdapterConfig
from modules.trainer.generic_trainer import GenericTrainer
from modules.trainer.guards import TrainingError, check_first_step, snapshot

TYPES = {
    "lora": {"type": "lora"}, "dora": {"type": "lora", "dora": True}, "loha": {"type": "loha"},
    "lokr": {"type": "lokr", "rank": 2}, "lokr-wd": {"type": "lokr", "rank": 2, "dora": True},
    "oft": {"type": "oft", "block_size": 4},
}


class CastingWrapper(nn.Module):
    """Keeps its block in fp16 and runs, every forward, an fp32 deep copy of it."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block.half()

    def forward(self, *args, **kwargs):
        compute = copy.deepcopy(self.block).float()
        cast = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        return compute(*cast, **kwargs)


def naive_hook(adapter: AdapterModule) -> None:
    """What an adapter whose hook is its own bound method does (this module's hook before issue 4)."""
    adapter._handle = adapter.base.register_forward_hook(adapter._forward_hook)


def one_step(kind: str, inject) -> tuple[list[AdapterModule], dict, nn.Module]:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    wrapper = CastingWrapper(block)
    size = {} if kind == "oft" else {"rank": 4, "alpha": 4}  # OFT has neither
    config = AdapterConfig(**{**size, **TYPES[kind]})
    adapters = nn.ModuleDict({f"lora_block_{i}": create_adapter(config, "block", f"lora_block_{i}", block[i],
                                                                 torch.device("cpu"), torch.float32)
                              for i in (0, 2)})
    for adapter in adapters.values():
        inject(adapter)
    named = list(adapters.named_parameters())
    before = snapshot(named)
    frozen = {k: v.clone() for k, v in block.state_dict().items()}
    optimizer = torch.optim.AdamW([p for _, p in named], lr=1e-2)
    x = torch.randn(8, 16)
    wrapper(x).square().mean().backward()
    optimizer.step()
    assert all(torch.equal(block.state_dict()[k], frozen[k]) for k in frozen)  # the base never moves
    return list(adapters.values()), before, adapters


@pytest.mark.parametrize("kind", TYPES)
def test_naive_injection_trains_a_copy_and_the_guard_stops_it(kind):
    _, before, tree = one_step(kind, naive_hook)
    named = list(tree.named_parameters())
    assert all(torch.equal(p, before[n]) for n, p in named)  # trains nothing
    with pytest.raises(TrainingError, match=r"2 module\(s\) received no gradient .*lora_block_0, lora_block_2"):
        check_first_step(named, before)


@pytest.mark.parametrize("kind", TYPES)
def test_our_hooks_keep_the_adapters_connected_through_the_copy(kind):
    adapters, before, tree = one_step(kind, AdapterModule.hook)
    named = list(tree.named_parameters())
    check_first_step(named, before)
    for adapter in adapters:
        assert any(not torch.equal(p, before[f"{adapter.name}.{n}"]) for n, p in adapter.named_parameters())


def test_the_guard_stops_a_real_run_with_the_naive_injection(tmp_path, tiny_model, shape_images, monkeypatch):
    """The trainer on the tiny model with one UNet transformer block wrapped: the naive hook makes
    the guard stop the run naming the adapters inside the wrapper; ours trains."""
    from modules.model.sd15 import SD15Family

    real_load = SD15Family.load

    def load_and_wrap(family):
        real_load(family)
        attentions = family.unet.down_blocks[0].attentions
        attentions[0] = CastingWrapper(attentions[0])

    monkeypatch.setattr(SD15Family, "load", load_and_wrap)
    config = train_config(tiny_model, shape_images, tmp_path, {"schedule": {"max_steps": 2},
                                                               "adapter": {"type": "lora", "dora": True}})
    ours = GenericTrainer(config)
    ours.start()
    wrapped = [a.name for a in ours.adapters if "attentions_0_block_" in a.name and "down_blocks_0" in a.name]
    assert wrapped
    ours.train()
    assert ours.step == 2

    monkeypatch.setattr(AdapterModule, "hook", naive_hook)
    naive = GenericTrainer(config.model_copy(update={"workspace_dir": str(tmp_path / "naive")}))
    naive.start()
    with pytest.raises(TrainingError, match="received no gradient") as error:
        naive.train()
    assert naive.step == 0 and all(name in str(error.value) for name in wrapped[:10])


def test_a_gradient_left_out_of_the_optimizer_is_caught_but_float_noise_that_rounds_away_is_not():
    # a tensor with a real gradient that did not move is out of the optimizer; one whose gradient is
    # float noise (1e-7 of the largest) may rightly round to no change (seen in test_sharded_variants)
    weight, bias, noise = (torch.nn.Parameter(torch.ones(4)) for _ in range(3))
    named = [("layer.weight", weight), ("layer.bias", bias), ("layer.extra", noise)]
    before = snapshot(named)
    weight.grad, bias.grad, noise.grad = torch.ones(4), torch.ones(4), torch.full((4,), 1e-7)
    with torch.no_grad():
        weight -= 0.1  # the optimizer stepped the weight only
    with pytest.raises(TrainingError, match=r"had a gradient but did not change .*layer\.bias"):
        check_first_step(named, before)
    check_first_step([("layer.weight", weight), ("layer.extra", noise)], before)  # only the noise did not move
