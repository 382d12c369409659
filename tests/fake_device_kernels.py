"""The aten ops that have their own fakegpu kernels: allocation, copies, resize, convolution, set_, group norm."""

from __future__ import annotations

import torch

import fake_device_streams
from fake_device_fallback import _fallback
from fake_device_tensors import (
    NAME, _alloc, _cpu_view, _fake_storage, _is_fake, _point_at, _resize, _same_device_error, _wrap, aten,
)


def _as_cpu(t: torch.Tensor) -> torch.Tensor:
    if not _is_fake(t):
        return t
    view = _cpu_view(t)
    # a lazily conjugated or negated view (complex RoPE's backward) keeps its bit, so the CPU copy resolves it
    if t.is_conj():
        view = view.conj()
    if t.is_neg():
        view = torch._neg_view(view)
    return view


def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    cpu = torch.empty(size, dtype=dtype, memory_format=memory_format or torch.contiguous_format)
    return _wrap(cpu)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return _alloc(size, stride, dtype)


def _copy_from(self, dst, non_blocking=False):
    # Reached for every copy_ that involves a fakegpu tensor (cpu<->fakegpu and fakegpu<->fakegpu);
    # fake_device_streams decides when it lands.
    fake_device_streams.copy(self, dst, non_blocking, lambda: _as_cpu(dst).copy_(_as_cpu(self)))
    return dst


def _record_stream(self, stream):
    pass  # no caching allocator to hold memory back: a pending copy keeps its tensors alive


def _copy_from_and_resize(self, dst):
    _resize(dst, self.size())
    return _copy_from(self, dst)


def _to_copy(self, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    # Dispatched here when the source or the target is fakegpu.
    device = torch.device(device) if device is not None else self.device
    fmt = memory_format or torch.preserve_format
    if device.type == NAME and not _is_fake(self):
        # host to device: a real copy, which fake_device_streams may leave pending
        staged = self if dtype in (None, self.dtype) else self.to(dtype, memory_format=fmt)
        dst = _wrap(torch.empty_like(staged, memory_format=fmt))
        return _copy_from(staged, dst, non_blocking)
    cpu = _as_cpu(self).to(dtype=dtype or self.dtype, memory_format=fmt, copy=True)
    if device.type == NAME:
        return _wrap(cpu)
    fake_device_streams.current_stream()._complete()  # a blocking copy to the host syncs its stream
    if device.type == "cpu":
        return cpu
    return cpu.to(device)


def _check_same(op_name, *tensors):
    for t in tensors:
        if isinstance(t, torch.Tensor) and not _is_fake(t) and t.dim() > 0:
            raise _same_device_error(op_name)


def _convolution_overrideable(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    _check_same("convolution_overrideable", input, weight, bias)
    out = aten.convolution.default(
        _as_cpu(input), _as_cpu(weight), None if bias is None else _as_cpu(bias),
        stride, padding, dilation, transposed, output_padding, groups,
    )
    return _wrap(out)


def _convolution_backward_overrideable(
    grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    _check_same("convolution_backward_overrideable", grad_output, input, weight)
    grads = aten.convolution_backward.default(
        _as_cpu(grad_output), _as_cpu(input), _as_cpu(weight), [weight.size(0)] if not transposed else [weight.size(1) * groups],
        stride, padding, dilation, transposed, output_padding, groups, output_mask,
    )
    return tuple(None if g is None else _wrap(g) for g in grads)


def _set_source_storage(self, source):
    return _point_at(self, _to_fake_storage(source), 0, [source.nbytes() // self.element_size()], [1])


def _set_source_storage_offset(self, source, storage_offset, size, stride=()):
    if not stride:
        stride = torch.empty(size, device="meta").stride()
    return _point_at(self, _to_fake_storage(source), storage_offset, size, stride)


def _set_source_tensor(self, source):
    if not _is_fake(source):
        raise _same_device_error("set_")
    return _point_at(self, source.untyped_storage(), source.storage_offset(), source.size(), source.stride())


def _set_empty(self):
    return _point_at(self, _fake_storage(torch.UntypedStorage(0)), 0, [0], [1])


def _to_fake_storage(source):
    if isinstance(source, torch.TypedStorage):
        source = source.untyped_storage
    if source.device.type != NAME:
        raise _same_device_error("set_")
    return source


def _native_group_norm(*args):
    # torch's CompositeExplicitAutograd kernel (used for devices without their own) views the input
    # as (N, G, -1), which fails on the channels-last layout that at::group_norm keeps, e.g. for a
    # VAE mid-block attention output at batch >= 2; the CPU kernel handles every layout.
    return _fallback(aten.native_group_norm.default, *args)


def _has_compatible_shallow_copy_type(self, src):
    # torch only counts CPU/CUDA/... as dense backends, so without this `param.data = t` between
    # cpu and fakegpu fails, and Module.to replaces Parameters instead of updating them in place.
    return self.layout == torch.strided and src.layout == torch.strided
