"""Attention kernels while training: flash, then memory-efficient, then math, and the process's
own choice back afterwards.

`scaled_dot_product_attention` picks its kernel from process-wide flags and a priority order,
which libraries and earlier code may have changed. Training pins them: flash attention and the
memory-efficient kernel first (on CUDA they need O(n) memory instead of math's O(n^2) attention
matrix), math last as the fallback for inputs the fused kernels refuse, so nothing that runs today
stops running; cuDNN attention and the "overrideable" backend off, so a run uses the same kernels
whatever the process's defaults (torch has moved cuDNN attention in and out of first place between
releases). A device without a kernel falls through to the next, so the same pin serves CPU and
test devices.

The state is snapshotted and restored exactly, even when training raises: the GUI and tests run
several trainings in one process. torch's `sdpa_kernel(..., set_priority=True)` restores only the
order of the backends that were enabled, so a disabled backend's place in the order could move.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

PINNED = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
# torch._C's flag names per backend (torch.backends.cuda has public getters for four of the five)
_FLAGS = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "mem_efficient",
          SDPBackend.MATH: "math", SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.OVERRIDEABLE: "overrideable"}


@dataclass(frozen=True)
class SdpaState:
    enabled: tuple[tuple[SDPBackend, bool], ...]
    priority: tuple[int, ...]


def current_state() -> SdpaState:
    return SdpaState(tuple((backend, bool(getattr(torch._C, f"_get_{flag}_sdp_enabled")()))
                           for backend, flag in _FLAGS.items()),
                     tuple(int(b) for b in torch._C._get_sdp_priority_order()))


def restore_state(state: SdpaState) -> None:
    for backend, enabled in state.enabled:
        getattr(torch._C, f"_set_sdp_use_{_FLAGS[backend]}")(enabled)
    torch._C._set_sdp_priority_order(list(state.priority))


def _pin() -> None:
    for backend, flag in _FLAGS.items():
        getattr(torch._C, f"_set_sdp_use_{flag}")(backend in PINNED)
    order = [int(b) for b in PINNED]
    torch._C._set_sdp_priority_order(order + [b for b in torch._C._get_sdp_priority_order() if b not in order])


@contextlib.contextmanager
def pinned_sdpa():
    """The pinned attention kernels inside, the state from before outside (also after an error)."""
    before = current_state()
    try:
        _pin()
        yield
    finally:
        restore_state(before)


def with_pinned_sdpa(method):
    """Decorator: run the method with the pinned attention kernels."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with pinned_sdpa():
            return method(*args, **kwargs)
    return wrapper
