"""The fake device's CUDA hazards (tests/fake_device_streams.py): late copies, pinned memory,
capacity and memory counters. Each is what a test relies on to catch a missing wait or a leak."""

from __future__ import annotations

import gc

import pytest
import torch

from modules.util.async_devices import async_device, has_streams


def _module():
    return torch.get_device_module("fakegpu")


def _pinned(values: torch.Tensor) -> torch.Tensor:
    home = _module().empty_pinned(values.numel() * values.element_size()).view(values.dtype).view(values.shape)
    return home.copy_(values)


def test_the_fake_device_takes_the_streams_path_and_the_cpu_does_not(fake_device):
    assert has_streams(fake_device) and has_streams("fakegpu:0")
    assert not has_streams("cpu") and async_device("meta") is None
    assert async_device(fake_device).streams is _module()


def test_a_side_stream_copy_lands_only_when_waited_for(fake_device):
    mod = _module()
    source = _pinned(torch.arange(6.0))
    side = mod.Stream(fake_device)
    with mod.stream(side):
        moved = source.to(fake_device, non_blocking=True)
    assert moved.cpu().isnan().all(), "before any wait the destination holds garbage"
    event = mod.Event()
    event.record(side)
    assert not event.query() and not side.query()
    mod.current_stream(fake_device).wait_event(event)
    assert torch.equal(moved.cpu(), torch.arange(6.0)) and event.query()
    # the same through the stream itself, and through a device-wide synchronize
    for wait in (lambda: mod.current_stream().wait_stream(side), side.synchronize, mod.synchronize):
        with mod.stream(side):
            again = source.to(fake_device, non_blocking=True)
        assert again.cpu().isnan().all()
        wait()
        assert torch.equal(again.cpu(), torch.arange(6.0))


def test_a_late_copy_reads_its_source_when_it_runs_and_an_event_covers_only_what_came_before(fake_device):
    mod = _module()
    side = mod.Stream()
    first, second = _pinned(torch.ones(3)), _pinned(torch.full((3,), 2.0))
    with mod.stream(side):
        a = first.to(fake_device, non_blocking=True)
        event = side.record_event()
        b = second.to(fake_device, non_blocking=True)
    event.synchronize()
    assert torch.equal(a.cpu(), torch.ones(3)) and b.cpu().isnan().all()
    second.fill_(5.0)  # the host wrote the source before the copy ran: the copy sees it
    side.synchronize()
    assert torch.equal(b.cpu(), torch.full((3,), 5.0))


def test_pageable_memory_and_blocking_copies_are_synchronous_and_pinned_memory_is_told_apart(fake_device):
    mod = _module()
    side = mod.Stream()
    pageable = torch.arange(4.0)
    pinned = _pinned(pageable)
    assert mod.is_pinned(pinned) and mod.is_pinned(pinned[1:]) and not mod.is_pinned(pageable)
    assert not pinned.is_pinned()  # torch's own check knows nothing of the fake's pinned memory
    with mod.stream(side):
        from_pageable = pageable.to(fake_device, non_blocking=True)
        blocking = pinned.to(fake_device)
    assert torch.equal(from_pageable.cpu(), pageable) and torch.equal(blocking.cpu(), pageable)
    # on the compute stream a copy to the device is ordered before what follows: it lands at once
    assert torch.equal(pinned.to(fake_device, non_blocking=True).cpu(), pageable)


def test_a_copy_into_pinned_memory_lands_when_the_host_waits_for_its_stream(fake_device):
    mod = _module()
    device_values = torch.arange(5.0).to(fake_device)
    home = _pinned(torch.zeros(5))
    home.copy_(device_values, non_blocking=True)
    device_values.add_(100)  # issued after the copy on the same stream: the copy read the old values
    assert home.isnan().all()
    mod.current_stream().synchronize()
    assert torch.equal(home, torch.arange(5.0))
    pageable = torch.zeros(5)
    pageable.copy_(device_values, non_blocking=True)
    assert torch.equal(pageable, torch.arange(5.0) + 100)  # into pageable memory: synchronous


def test_pinned_allocations_are_rounded_to_a_power_of_two_and_given_back(fake_device):
    mod = _module()
    gc.collect()
    before = mod.pinned_bytes()
    buffer = mod.empty_pinned(3000)
    assert buffer.numel() == 3000 and mod.pinned_bytes() - before == 4096
    del buffer
    gc.collect()
    assert mod.pinned_bytes() == before


def test_memory_counters_and_capacity(fake_device):
    mod = _module()
    gc.collect()
    base = mod.memory_allocated()
    mod.reset_peak_memory_stats()
    a = torch.empty(1000, dtype=torch.float32, device=fake_device)
    b = (a.fill_(1) * 2).to(torch.float16)  # a float32 temporary, then the float16 result
    del a
    gc.collect()
    assert mod.memory_allocated() - base == 2000
    assert mod.max_memory_allocated() - base == 8000 + 2000  # a and the temporary at once
    mod.set_memory_capacity(mod.memory_allocated() + 4000)
    try:
        kept = torch.ones(1000, device=fake_device)  # exactly at the capacity: fits
        assert mod.mem_get_info()[0] == 0
        with pytest.raises(torch.OutOfMemoryError, match="fakegpu out of memory: tried to allocate 4 bytes"):
            torch.ones(1, device=fake_device)
        del kept
        gc.collect()
        torch.ones(1, device=fake_device)
    finally:
        mod.set_memory_capacity(None)
    del b
    gc.collect()
    assert mod.memory_allocated() == base
