"""The conductor's streams path (prefetch on a side stream, pinned arenas, asynchronous
write-back) on the fake device, which leaves a copy's destination as NaN until someone waits for
it (tests/fake_device_streams.py): a missing wait gives wrong numbers here, as it would on CUDA."""

from __future__ import annotations

import gc

import pytest
import torch
from test_fine_tune_offload import _train_toy
from test_offload import start, toy_stack
from torch import nn

from modules.offload.conductor import LayerOffloadConductor
from modules.offload.layer_tensors import block_bytes, layer_tensors
from modules.offload.pinned_arenas import ALIGNMENT, plan_arenas


def _device_module():
    return torch.get_device_module("fakegpu")


@pytest.mark.parametrize("quantized", [False, True])
def test_prefetched_pinned_blocks_give_the_same_steps_as_no_offloading(fake_device, quantized):
    # fails when the compute stream does not wait for a prefetch: the block computes with NaN
    model, blocks = toy_stack(quantized)
    reference, _ = toy_stack(quantized)
    reference.to(fake_device)
    conductor = start(model, blocks, fake_device)
    assert conductor.kit is not None and conductor._stream is not None  # the streams path, not the plain one
    assert all(conductor.kit.is_pinned(home) for index in conductor.parked for home in conductor._home[index])
    x = torch.randn(8, 32, device=fake_device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    for _ in range(3):  # several steps: the second block of each window arrives by the side stream
        out, expected = model(x), reference(x_ref)
        out.square().sum().backward()
        expected.square().sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x.grad, x_ref.grad)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x_ref))  # forward-only passes too
    assert conductor.moves > 2 * len(conductor.parked)


def test_parked_updates_are_home_when_the_backward_returns(fake_device):
    # fails when the host does not wait for the asynchronous write-backs before the backward
    # returns: a save right after a step would read a home still being written (NaN here)
    plain, *_ = _train_toy(fake_device, 0.0, steps=2)
    model, blocks = toy_stack(quantized=False)
    model.requires_grad_(True)
    conductor = start(model, blocks, fake_device)
    from test_fine_tune_offload import _fused_adamw

    conductor.carry_optimizer_state(_fused_adamw(model))
    torch.manual_seed(1)
    for x in [torch.randn(4, 32) for _ in range(2)]:
        model(x.to(fake_device)).square().mean().backward()
    away = [i for i in conductor.parked if i not in conductor.resident]
    assert away
    for index in away:
        for tensor in layer_tensors(blocks[index]):
            assert tensor.get().device.type == "cpu"
    for ours, theirs in zip(model.parameters(), plain.parameters()):  # read as a save reads them: no evict
        torch.testing.assert_close(ours.detach().cpu(), theirs.detach().cpu(), atol=1e-6, rtol=0)


def test_the_parked_blocks_move_to_the_temp_device_when_the_conductor_starts(fake_device):
    # the whole part on the train device first (as a part placed there before offloading is set up)
    model, blocks = toy_stack(quantized=False)
    model.to(fake_device)
    mod = _device_module()
    gc.collect()
    on_device = mod.memory_allocated()
    conductor = start(model, blocks, fake_device)
    gc.collect()
    parked_bytes = sum(block_bytes(blocks[i]) for i in conductor.parked)
    away = [i for i in conductor.parked if i not in conductor.resident]
    assert away
    for index in away:
        assert {t.get().device.type for t in layer_tensors(blocks[index])} == {"cpu"}, index
        assert all(conductor.kit.is_pinned(t.get()) for t in layer_tensors(blocks[index]))
    # the train device gave back what the parked blocks away from it held
    freed = on_device - mod.memory_allocated()
    assert freed >= sum(block_bytes(blocks[i]) for i in away) > 0
    assert freed <= parked_bytes


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(96, 80), nn.Linear(80, 96)
        self.norm = nn.LayerNorm(96)

    def forward(self, x):
        return self.norm(x + self.b(torch.nn.functional.gelu(self.a(x))))


def test_parked_weights_sit_in_a_few_pinned_arenas_not_one_allocation_each(fake_device):
    torch.manual_seed(0)
    blocks = [Wide() for _ in range(24)]
    model = nn.Sequential(*blocks).requires_grad_(False)
    mod = _device_module()
    gc.collect()
    before = mod.pinned_bytes()
    conductor = LayerOffloadConductor(blocks, 0.5, fake_device, torch.device("cpu"), "toy")
    conductor.start()
    pinned = mod.pinned_bytes() - before
    parked_bytes = sum(block_bytes(blocks[i]) for i in conductor.parked)
    homes = [h for i in conductor.parked for h in conductor._home[i]]
    arenas = {h.untyped_storage().data_ptr() for h in homes}
    assert len(homes) == 6 * len(conductor.parked) and len(arenas) <= len(homes) // 8
    # one allocation per tensor would pin 1.07x here (each weight rounded up to a power of two)
    assert parked_bytes <= pinned <= 1.035 * parked_bytes
    for child in model.modules():
        if id(child) not in conductor.owned_modules():
            child._apply(lambda t: t.to(fake_device), recurse=False)
    torch.manual_seed(0)
    reference = nn.Sequential(*[Wide() for _ in range(24)]).requires_grad_(False)
    x = torch.randn(3, 96)
    with torch.no_grad():  # the views hold the weights: the same outputs
        torch.testing.assert_close(model(x.to(fake_device)).cpu(), reference(x))


def test_the_arena_plan_places_every_tensor_aligned_without_overlap_in_power_of_two_arenas():
    sizes = [30720, 320, 320, 320, 1, 63, 64, 65, 12345, 1 << 16, 3 * (1 << 15)] * 20  # each <= 1/40 of all
    plan = plan_arenas(sizes)
    assert all(a & (a - 1) == 0 for a in plan.arena_bytes)
    spans = {}
    for size, (arena, offset) in zip(sizes, plan.placements):
        assert offset % ALIGNMENT == 0 and offset + size <= plan.arena_bytes[arena]
        spans.setdefault(arena, []).append((offset, offset + size))
    for ranges in spans.values():
        ranges.sort()
        assert all(end <= next_start for (_, end), (next_start, _) in zip(ranges, ranges[1:]))
    assert plan.pinned_bytes <= 1.02 * sum(-(-s // ALIGNMENT) * ALIGNMENT for s in sizes)
    assert plan_arenas([]).pinned_bytes == 0


def test_the_device_peak_with_half_offloaded_is_the_resident_blocks_two_parked_ones_and_the_rest(fake_device):
    # live device bytes as each block starts, through a training step and a forward-only pass,
    # after a collection (the fake device frees a storage when its Python object goes, which
    # can wait for the garbage collector)
    mod = _device_module()
    x = torch.randn(8, 32)

    def peak(fraction):
        gc.collect()
        before = mod.memory_allocated()
        model, blocks = toy_stack(quantized=False)
        conductor = start(model, blocks, fake_device, fraction) if fraction else None
        if conductor is None:
            model.to(fake_device)
        live = []

        def sample(module, args):
            gc.collect(1)  # the young generations: what a pass leaves behind
            live.append(mod.memory_allocated() - before)

        for wrapper in model:
            wrapper.register_forward_pre_hook(sample)
        inputs = x.to(fake_device).requires_grad_(True)
        model(inputs).square().sum().backward()
        with torch.no_grad():
            model(inputs)
        return max(live), [block_bytes(b) for b in blocks], conductor and conductor.parked

    plain, sizes, _ = peak(0.0)
    half, _, parked = peak(0.5)
    two_parked = sum(sorted(sizes[i] for i in parked)[-2:])
    # plain holds every block and the rest (activations, gradients, the input): offloading keeps
    # two parked blocks of it on the device at a time
    assert half <= plain - sum(sizes[i] for i in parked) + two_parked


def test_a_real_width_sdxl_unet_half_parked_pins_at_most_1_02x_its_parked_bytes():
    # planned on the meta device from the shipped config (benchmarks/offload_pinned.py prints it
    # for FLUX.1 too); one pinned allocation per tensor would take 1.33x here
    from benchmarks.offload_pinned import measure, skeleton_blocks

    figures = measure(skeleton_blocks("sdxl", "unet", "diffusers.UNet2DConditionModel", torch.bfloat16), 0.5)
    assert figures["parked_gb"] > 2 and figures["per_tensor_ratio"] > 1.3
    assert figures["pinned_ratio"] <= 1.02 and figures["arenas"] <= 16


def test_a_block_brought_back_right_after_its_write_back_reads_the_written_home(fake_device):
    # the schedule rarely re-brings a block the moment it left (a shallower prefetch would): the
    # copy out of its home must wait for the write-back into it, or it brings back garbage
    model, blocks, conductor, _ = _train_toy(fake_device, 0.5, steps=1)
    conductor.materialize()
    index = next(i for i in conductor.parked if i in conductor.resident)
    conductor._changed.add(index)
    expected = [t.get().detach().cpu().clone() for t in layer_tensors(blocks[index])]
    conductor._send_away(index)  # the write-back is still on its way home
    conductor._bring(index, prefetch=False)
    for tensor, value in zip(layer_tensors(blocks[index]), expected):
        assert tensor.get().device.type == fake_device.type
        assert torch.equal(tensor.get().detach().cpu(), value)
