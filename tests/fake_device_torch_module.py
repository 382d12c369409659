"""torch.fakegpu: the device module torch looks up by name (RNG, streams, events, memory counters;
checkpointing, amp). Beyond CUDA's names: ``set_memory_capacity(nbytes or None)``, ``empty_pinned``,
``is_pinned`` and ``pinned_bytes`` (fake_device_streams.py)."""

from __future__ import annotations

import types

import torch

import fake_device_streams
from fake_device_tensors import MEMORY, NAME, _generator


def _make_device_module() -> types.ModuleType:
    mod = types.ModuleType(f"torch.{NAME}")
    mod.__doc__ = "Fake second device backed by CPU memory (tests/fake_device.py)."

    def manual_seed(seed: int) -> None:
        _generator.manual_seed(int(seed))

    def seed() -> None:
        _generator.seed()

    def get_rng_state(device="fakegpu") -> torch.Tensor:
        return _generator.get_state()

    def set_rng_state(new_state: torch.Tensor, device="fakegpu") -> None:
        _generator.set_state(new_state)

    class device:
        """``with torch.fakegpu.device(i)``: a no-op, there is one device.

        torch._utils._to (Storage.to, torch.load with map_location="fakegpu") enters this with a
        torch.device and then allocates a storage through PrivateUse1's allocator, which does not
        exist in a Python backend and would crash the process: refuse that path loudly here.
        Checkpointing enters it with an int index, which is fine.
        """

        def __init__(self, device):
            if isinstance(device, torch.device) and device.type == NAME:
                raise RuntimeError(
                    f"{NAME} has no storage allocator: load or build storages on cpu, then move tensors with .to()"
                )

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def reset_peak_memory_stats(device=None) -> None:
        MEMORY.reset_peak()

    def mem_get_info(device=None) -> tuple[int, int]:
        total = MEMORY.capacity if MEMORY.capacity is not None else 1 << 40
        return total - MEMORY.allocated, total

    def set_memory_capacity(nbytes: int | None) -> None:
        """Past it an allocation raises torch.OutOfMemoryError (None: no limit)."""
        MEMORY.capacity = nbytes

    functions = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_is_in_bad_fork": lambda: False,
        "init": lambda: None,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": fake_device_streams.synchronize,
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed,
        "seed": seed,
        "seed_all": seed,
        "initial_seed": lambda: _generator.initial_seed(),
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
        "get_rng_state_all": lambda: [get_rng_state()],
        "set_rng_state_all": lambda states: set_rng_state(states[0]),
        "is_bf16_supported": lambda including_emulation=True: True,
        "get_amp_supported_dtype": lambda: [torch.float16, torch.bfloat16],
        "current_stream": fake_device_streams.current_stream,
        "default_stream": fake_device_streams.default_stream,
        "stream": fake_device_streams.StreamContext,
        "empty_cache": lambda: None,
        "memory_allocated": lambda device=None: MEMORY.allocated,
        "memory_reserved": lambda device=None: MEMORY.allocated,
        "max_memory_allocated": lambda device=None: MEMORY.peak,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "mem_get_info": mem_get_info,
        "set_memory_capacity": set_memory_capacity,
        "empty_pinned": fake_device_streams.empty_pinned,
        "is_pinned": fake_device_streams.is_pinned,
        "pinned_bytes": fake_device_streams.pinned_bytes,
        "Stream": fake_device_streams.Stream,
        "Event": fake_device_streams.Event,
        "device": device,
    }
    for name, fn in functions.items():
        setattr(mod, name, fn)
    # Non-reentrant checkpointing saves and restores device RNG only when this is set.
    mod._initialized = True
    return mod
