"""Devices with CUDA-style streams, events and pinned host memory, and how to reach them.

Code that overlaps copies with compute (the layer offload conductor) asks `async_device(device)`
instead of testing `device.type == "cuda"`: CUDA answers, and so does any device that registers
itself here. The CPU test suite's fake device (tests/fake_device.py) registers, with CUDA's
hazards modelled, so the code path that uses streams runs (and can fail) without a GPU.
Where this returns None, copies are plain synchronous ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass(frozen=True)
class AsyncDevice:
    # torch.cuda or an equivalent: Stream, Event, current_stream(device), stream(s) as a context
    streams: ModuleType
    # nbytes of page-locked host memory as a uint8 CPU tensor (non_blocking copies need it)
    empty_pinned: Callable[[int], torch.Tensor]
    is_pinned: Callable[[torch.Tensor], bool]
    # a pinned copy of a CPU tensor that cannot live in an arena (a tensor subclass such as torchao's)
    pin: Callable[[torch.Tensor], torch.Tensor]


def _cuda_empty_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


_CUDA = AsyncDevice(torch.cuda, _cuda_empty_pinned, lambda tensor: tensor.is_pinned(),
                    lambda tensor: tensor.pin_memory())
_REGISTERED: dict[str, AsyncDevice] = {}


def register_async_device(device_type: str, capabilities: AsyncDevice) -> None:
    """Make `device_type` take the streams-and-pinned-memory path (a test device does this)."""
    _REGISTERED[device_type] = capabilities


def async_device(device: torch.device | str) -> AsyncDevice | None:
    """The streams and pinned memory of `device`'s type, or None where it has none."""
    device_type = torch.device(device).type
    return _CUDA if device_type == "cuda" else _REGISTERED.get(device_type)


def has_streams(device: torch.device | str) -> bool:
    return async_device(device) is not None

