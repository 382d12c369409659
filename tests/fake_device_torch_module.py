"""torch.fakegpu: the device module torch looks up by name (RNG, streams, events; checkpointing, amp)."""

from __future__ import annotations

import types

import torch

import fake_device_tensors
from fake_device_tensors import NAME, _generator


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

    class Stream:
        """Streams are no-ops: every op runs synchronously on the CPU."""

        def __init__(self, device=None, priority=0, **kwargs):
            self.device = fake_device_tensors._DEV0  # set by enable_fake_device()

        def synchronize(self) -> None:
            pass

        def wait_stream(self, stream) -> None:
            pass

        def wait_event(self, event) -> None:
            pass

        def record_event(self, event=None):
            return event if event is not None else Event()

        def query(self) -> bool:
            return True

    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            pass

        def record(self, stream=None) -> None:
            pass

        def wait(self, stream=None) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return True

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

    class _StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            return self.stream

        def __exit__(self, *exc):
            return False

    functions = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_is_in_bad_fork": lambda: False,
        "init": lambda: None,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
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
        "current_stream": lambda device=None: Stream(),
        "default_stream": lambda device=None: Stream(),
        "stream": lambda stream: _StreamContext(stream),
        "empty_cache": lambda: None,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "Stream": Stream,
        "Event": Event,
        "device": device,
    }
    for name, fn in functions.items():
        setattr(mod, name, fn)
    # Non-reentrant checkpointing saves and restores device RNG only when this is set.
    mod._initialized = True
    return mod
