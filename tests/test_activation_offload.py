"""Activation offloading: what a checkpointed block keeps for its recomputation waits on the temp
device, however the block is called. The train device is the fake second device
(tests/fake_device.py), the temp device the CPU; the block is diffusers' own Flux double block,
tiny, called with keywords as FluxTransformer2DModel calls it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.utils.checkpoint as checkpoint_module
from torch import nn
from torch.utils._pytree import tree_flatten

from modules.offload.checkpointing import checkpoint_blocks_

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def flux_block_weights():
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    torch.manual_seed(0)
    return FluxTransformerBlock(dim=32, num_attention_heads=2, attention_head_dim=16).state_dict()


def flux_block(weights, device, offload_to):
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    block = FluxTransformerBlock(dim=32, num_attention_heads=2, attention_head_dim=16)
    block.load_state_dict(weights)
    block.to(device)
    checkpoint_blocks_([block], offload_to)
    return block


def block_inputs(device):
    generator = torch.Generator().manual_seed(1)
    leaf = torch.randn(1, 12, 32, generator=generator).to(device).requires_grad_(True)
    text = torch.randn(1, 4, 32, generator=generator).to(device)
    temb = torch.randn(1, 32, generator=generator).to(device)
    angles = torch.randn(16, 8, generator=generator)
    rotary = (angles.cos().repeat_interleave(2, -1).to(device), angles.sin().repeat_interleave(2, -1).to(device))
    return leaf, text, temb, rotary


def call(block, leaf, text, temb, rotary):
    # a non-leaf, as a previous block's output is: nothing but the checkpoint could keep it alive
    hidden = leaf * 1.0
    kept = weakref.ref(hidden)
    text_out, hidden_out = block(hidden_states=hidden, encoder_hidden_states=text, temb=temb, image_rotary_emb=rotary)
    del hidden
    return (text_out.square().sum() + hidden_out.square().sum()), kept


def test_a_flux_block_called_with_keywords_keeps_its_inputs_on_the_temp_device(fake_device, flux_block_weights,
                                                                                monkeypatch):
    kept_devices = []
    original = checkpoint_module.checkpoint

    def recording(function, *args, **kwargs):
        kept_devices.extend(t.device.type for t in tree_flatten((args, kwargs))[0]
                            if isinstance(t, torch.Tensor) and t.numel())
        return original(function, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "checkpoint", recording)
    grads = {}
    for offload_to in (CPU, None):
        kept_devices.clear()
        block = flux_block(flux_block_weights, fake_device, offload_to)
        leaf, text, temb, rotary = block_inputs(fake_device)
        loss, kept = call(block, leaf, text, temb, rotary)
        gc.collect()
        # the block's input on the train device is gone between the forward and the backward
        assert (kept() is None) == (offload_to is not None)
        assert sorted(kept_devices) == (["cpu"] * 5 if offload_to else [fake_device.type] * 5)
        loss.backward()
        grads[offload_to] = [leaf.grad.cpu(), *(p.grad.cpu() for p in block.parameters())]
    for offloaded, plain in zip(grads[CPU], grads[None]):
        torch.testing.assert_close(offloaded, plain, atol=1e-6, rtol=0)


class Biased(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, hidden_states, *, bias):
        return self.linear(hidden_states) + bias


def test_a_tensor_given_to_several_blocks_is_copied_once(fake_device, monkeypatch):
    # a time embedding or rotary table goes to every block: one copy on the temp device, not one each
    kept = []
    original = checkpoint_module.checkpoint

    def recording(function, *args, **kwargs):
        kept.append([t for t in args if isinstance(t, torch.Tensor) and t.numel()])
        return original(function, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "checkpoint", recording)
    blocks = [Biased().to(fake_device) for _ in range(2)]
    checkpoint_blocks_(blocks, CPU)
    shared = torch.randn(2, 8, device=fake_device)
    x = torch.randn(2, 8, device=fake_device, requires_grad=True)
    blocks[1](blocks[0](x, bias=shared), bias=shared).sum().backward()
    (first_input, first_bias), (second_input, second_bias) = kept
    assert {t.device.type for t in (first_input, first_bias, second_input, second_bias)} == {"cpu"}
    assert first_bias.data_ptr() == second_bias.data_ptr() and first_input.data_ptr() != second_input.data_ptr()
    assert x.grad is not None


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.dropout = nn.Linear(16, 16), nn.Dropout(0.5)

    def forward(self, *, hidden_states, scale):
        return self.dropout(self.linear(hidden_states)) * scale


@pytest.mark.parametrize("offload_to", [CPU, None])
def test_the_recomputation_draws_the_dropout_mask_of_the_forward(fake_device, offload_to):
    # the checkpoint saves the random state only of devices among its positional inputs: called
    # with keywords, or with every input offloaded to the CPU, a block's recomputation would draw
    # a different dropout mask from its forward's, and the grads would be wrong
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        block = Noisy().to(fake_device)
        if checkpointed:
            checkpoint_blocks_([block], offload_to)
        x = torch.randn(4, 16, device=fake_device, requires_grad=True)
        torch.manual_seed(1)
        block(hidden_states=x * 1.0, scale=torch.tensor(2.0, device=fake_device)).square().sum().backward()
        grads.append(x.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=0)



@pytest.mark.parametrize("offload_to", [CPU, None])
def test_a_compiled_checkpointed_block_traces_in_one_graph_and_matches_eager(fake_device, offload_to):
    # regional compile compiles the checkpointed blocks: a side effect in the checkpointed function
    # (handing the originals over once) would break the graph and run the block eagerly
    import torch._dynamo.utils as dynamo_utils

    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)).to(fake_device)
        if compiled:
            checkpoint_blocks_([block], offload_to)
            block.compile(dynamic=True, backend="aot_eager")
        x = torch.randn(4, 16, device=fake_device, requires_grad=True)
        dynamo_utils.counters.clear()
        block(x * 1.0).square().sum().backward()
        grads.append(x.grad.cpu())
    assert not dynamo_utils.counters["graph_break"] and dynamo_utils.counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_inputs_wait_in_pinned_memory_and_the_grads_are_unchanged(flux_block_weights, monkeypatch):
    device = torch.device("cuda")
    kept = []
    original = checkpoint_module.checkpoint

    def recording(function, *args, **kwargs):
        kept.extend(t for t in args if isinstance(t, torch.Tensor) and t.numel())
        return original(function, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "checkpoint", recording)
    grads = {}
    for offload_to in (CPU, None):
        kept.clear()
        block = flux_block(flux_block_weights, device, offload_to)
        leaf, text, temb, rotary = block_inputs(device)
        loss, _ = call(block, leaf, text, temb, rotary)
        assert all(t.is_pinned() for t in kept) == (offload_to is not None)
        loss.backward()
        grads[offload_to] = [leaf.grad.cpu(), *(p.grad.cpu() for p in block.parameters())]
    for offloaded, plain in zip(grads[CPU], grads[None]):
        torch.testing.assert_close(offloaded, plain, atol=1e-5, rtol=0)
