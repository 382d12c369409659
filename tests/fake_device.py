"""A fake second torch device, ``fakegpu``, so device-placement bugs show on a CPU-only machine.

Placement bugs (a weight on the CPU and its scale on the GPU, an adapter created where a parked
weight sits) only raise when two devices exist. This module renames torch's PrivateUse1 backend to
``fakegpu`` and backs it with CPU memory:

- a fakegpu tensor's storage points at the memory of a CPU storage, which it keeps alive;
- every aten op without a PrivateUse1 kernel reaches one boxed Python fallback, which refuses to mix
  non-scalar CPU tensors with fakegpu tensors (the same message CUDA gives), runs the real CPU
  kernel on CPU views of the same memory, and wraps the results back as fakegpu tensors;
- a few ops that move data between devices or change a tensor's storage get their own kernels.

Use ``enable_fake_device()`` (or the ``fake_device`` fixture in conftest.py). It returns
``torch.device("fakegpu")`` (no index, like ``torch.device("cuda")``); tensors report ``fakegpu:0``.

CUDA's hazards (fake_device_streams.py): a non_blocking copy on a side stream lands only when
waited for (until then its destination holds NaN), pinned and pageable host memory are told apart
(``torch.fakegpu.empty_pinned``/``is_pinned``; the device registers with
modules/util/async_devices.py, so code takes its CUDA path here); device memory is counted
(``memory_allocated``, ``max_memory_allocated``, ``reset_peak_memory_stats``) and
``torch.fakegpu.set_memory_capacity(n)`` makes allocations past n raise torch.OutOfMemoryError.

Limits: one device index (``fakegpu:0``); compute runs at once, so a side stream that forgets to
wait for the compute stream is not caught, nor is device memory reused too early (no caching
allocator: a pending copy keeps its tensors alive); a storage counts as freed when its Python
object goes, which may wait for the garbage collector; ``Tensor.pin_memory()`` is unavailable;
``torch.Generator(device="fakegpu")`` cannot be created (torch's Python hooks cannot provide
``getNewGenerator``), and a CPU generator passed to a fakegpu op raises, as on CUDA; random ops on
fakegpu draw from one stream of their own, seeded by ``torch.manual_seed`` and saved/restored
through ``torch.fakegpu.get_rng_state``/``set_rng_state`` (what checkpointing uses);
growing a tensor with ``resize_`` gives it a new storage (other tensors sharing the old one keep the
old memory); storages cannot be allocated on fakegpu directly (no allocator from Python), so
``torch.load(..., map_location="fakegpu")`` raises: load to cpu, then ``.to()``; call
``enable_fake_device()`` before building ``torch.device("fakegpu")``; 20-80 us of Python per op.

The parts: fake_device_tensors.py (fakegpu tensors over CPU memory), fake_device_fallback.py (the
boxed fallback), fake_device_kernels.py (ops with their own kernels), fake_device_torch_module.py
(``torch.fakegpu``), fake_device_streams.py (streams, events, pinned memory); this file registers them.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

import fake_device_tensors
from fake_device_fallback import _fallback
from fake_device_kernels import (
    _convolution_backward_overrideable, _convolution_overrideable, _copy_from, _copy_from_and_resize,
    _empty_memory_format, _empty_strided, _has_compatible_shallow_copy_type, _native_group_norm, _record_stream,
    _set_empty,
    _set_source_storage, _set_source_storage_offset, _set_source_tensor, _to_copy,
)
from fake_device_tensors import NAME, _resize
from fake_device_torch_module import _make_device_module
from modules.util.async_devices import AsyncDevice, register_async_device

DEVICE: torch.device | None = None  # what enable_fake_device() returns
_MARK = "_fakegpu_impl"  # set on torch.fakegpu, so a second import of this file reuses the first setup


def enable_fake_device() -> torch.device:
    """Register the ``fakegpu`` device once per process; return ``torch.device("fakegpu")``."""
    global DEVICE
    existing = getattr(torch, NAME, None)
    if existing is not None and getattr(existing, _MARK, False):
        DEVICE, fake_device_tensors._DEV0 = torch.device(NAME), torch.device(NAME, 0)
        return DEVICE
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", NAME):
        raise RuntimeError(f"PrivateUse1 is already taken by backend {current!r}; cannot add {NAME!r}")

    mod = _make_device_module()
    _setup_privateuseone_for_python_backend(NAME, backend_module=mod)
    DEVICE, fake_device_tensors._DEV0 = torch.device(NAME), torch.device(NAME, 0)

    lib = torch.library.Library("_", "IMPL")  # noqa: TOR901 - a global fallback needs the "_" namespace
    lib.fallback(_fallback, "PrivateUse1")
    impls = torch.library.Library("aten", "IMPL")
    for op_name, fn in {
        "empty.memory_format": _empty_memory_format,
        "empty_strided": _empty_strided,
        "_copy_from": _copy_from,
        "_copy_from_and_resize": _copy_from_and_resize,
        "_to_copy": _to_copy,
        "resize_": _resize,
        "convolution_overrideable": _convolution_overrideable,
        "convolution_backward_overrideable": _convolution_backward_overrideable,
        "set_.source_Storage": _set_source_storage,
        "set_.source_Storage_storage_offset": _set_source_storage_offset,
        "set_.source_Tensor": _set_source_tensor,
        "set_": _set_empty,
        "_has_compatible_shallow_copy_type": _has_compatible_shallow_copy_type,
        "native_group_norm": _native_group_norm,
        "record_stream": _record_stream,
    }.items():
        impls.impl(op_name, fn, "PrivateUse1")
    # torch's conjugate and negative fallbacks materialise a lazy view by a clone, whose copy_ reaches
    # _copy_from with the bit still set: it recursed until the C stack overflowed (FIBO-2's complex RoPE)
    for key in ("Conjugate", "Negative"):
        impls.impl("_copy_from", _copy_from, key)

    # Libraries unregister their kernels when garbage collected: keep them with the device module.
    mod._libraries = (lib, impls)
    setattr(mod, _MARK, True)
    sys.modules.setdefault(f"torch.{NAME}", mod)
    # a tensor subclass cannot be copied into the fake's pinned buffers: it stays pageable (and
    # its non_blocking copies synchronous), which is correct, only without overlap
    register_async_device(NAME, AsyncDevice(mod, mod.empty_pinned, mod.is_pinned, lambda tensor: tensor))
    return DEVICE
