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

Limits: one device index (``fakegpu:0``); no pinned memory; streams and events are no-ops;
``torch.Generator(device="fakegpu")`` cannot be created (torch's Python hooks cannot provide
``getNewGenerator``), and a CPU generator passed to a fakegpu op raises, as on CUDA; random ops on
fakegpu draw from one stream of their own, seeded by ``torch.manual_seed`` and saved/restored
through ``torch.fakegpu.get_rng_state``/``set_rng_state`` (what checkpointing uses);
growing a tensor with ``resize_`` gives it a new storage (other tensors sharing the old one keep the
old memory); storages cannot be allocated on fakegpu directly (no allocator from Python), so
``torch.load(..., map_location="fakegpu")`` raises: load to cpu, then ``.to()``; call
``enable_fake_device()`` before building ``torch.device("fakegpu")``; 20-80 us of Python per op.
"""

from __future__ import annotations

import sys
import types

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

NAME = "fakegpu"
# torch.device("fakegpu") can only be built after the rename; enable_fake_device() fills these in.
DEVICE: torch.device | None = None  # what enable_fake_device() returns
_DEV0: torch.device | None = None  # what tensors and storages report
_CPU = torch.device("cpu")
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_OWNER_ATTR = "_fakegpu_cpu_owner"
_MARK = "_fakegpu_impl"  # set on torch.fakegpu, so a second import of this file reuses the first setup

aten = torch.ops.aten
_SET_STORAGE = aten.set_.source_Storage_storage_offset

# CUDA lets CPU index tensors join a device tensor in advanced indexing.
_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_", "aten::_unsafe_index"}

# RNG of the fake device: kept apart from the CPU default generator, as a GPU's is.
_generator = torch.Generator()


# ----------------------------------------------------------------------------------------------
# Moving between CPU memory and fakegpu tensors
# ----------------------------------------------------------------------------------------------


def _is_fake(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == NAME


def _fake_storage(cpu_storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A fakegpu storage over a CPU storage's memory.

    The storage built from a raw pointer owns nothing, so the CPU storage rides along as an
    attribute: torch preserves a storage's Python object (and its attributes) for as long as the
    C++ storage lives, so the CPU memory lives exactly as long as the fakegpu storage.
    """
    st = torch._C._construct_storage_from_data_pointer(cpu_storage.data_ptr(), _DEV0, cpu_storage.nbytes())
    setattr(st, _OWNER_ATTR, cpu_storage)
    return st


def _point_at(fake: torch.Tensor, storage, offset, size, stride) -> torch.Tensor:
    # The CPU kernel of set_ only edits TensorImpl metadata and checks that devices match, so it
    # can point a fakegpu tensor at a fakegpu storage without touching memory.
    return _SET_STORAGE.redispatch(_CPU_KEYS, fake, storage, offset, size, stride)


def _new_fake(dtype, storage, offset, size, stride) -> torch.Tensor:
    return _point_at(torch._C._acc.create_empty_tensor([0], dtype), storage, offset, size, stride)


def _wrap(cpu: torch.Tensor) -> torch.Tensor:
    """A fakegpu tensor sharing (and keeping alive) the memory of a CPU tensor."""
    return _new_fake(cpu.dtype, _fake_storage(cpu.untyped_storage()), cpu.storage_offset(), cpu.size(), cpu.stride())


def _cpu_view(fake: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same memory as a fakegpu tensor, valid while ``fake`` lives.

    Its storage is a non-owning, non-resizable view: a CPU kernel that tried to reallocate it
    would raise instead of freeing memory that fakegpu tensors still point at.
    """
    st = fake.untyped_storage()
    cpu_st = torch._C._construct_storage_from_data_pointer(st.data_ptr(), _CPU, st.nbytes())
    return torch.empty(0, dtype=fake.dtype).set_(cpu_st, fake.storage_offset(), fake.size(), fake.stride())


def _alloc(size, stride, dtype) -> torch.Tensor:
    cpu = torch.empty_strided(size, stride, dtype=dtype or torch.get_default_dtype())
    return _wrap(cpu)


def _same_device_error(op_name: str) -> RuntimeError:
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{NAME}:0 and cpu! (when checking argument for {op_name})"
    )


# ----------------------------------------------------------------------------------------------
# The boxed fallback: every op without its own PrivateUse1 kernel
# ----------------------------------------------------------------------------------------------


def _fallback(op, *args, **kwargs):
    try:
        return _run_on_cpu(op, args, kwargs, outs_to_temp=False)
    except RuntimeError as e:
        # An out= tensor had to grow, which the non-owning CPU view cannot do (the kernel resizes
        # before it computes anything): run again computing into fresh CPU memory.
        if "not resizable" not in str(e):
            raise
        return _run_on_cpu(op, args, kwargs, outs_to_temp=True)


_op_info_cache: dict = {}


def _op_info(op):
    """Per-op facts from the schema, computed once (the fallback runs for every op)."""
    info = _op_info_cache.get(op)
    if info is None:
        schema = op._schema
        args = schema.arguments
        writes = {a.name for a in args if a.alias_info is not None and a.alias_info.is_write}
        info = (
            schema.name,
            [a.name for a in args],
            {a.name for a in args if a.kwarg_only and a.name in writes},  # out= arguments
            writes,
            schema.name in _INDEX_OPS,
            torch.Tag.nondeterministic_seeded in op.tags,
        )
        _op_info_cache[op] = info
    return info


def _run_on_cpu(op, args, kwargs, outs_to_temp: bool):
    op_name, names, out_names, write_names, index_op, seeded = _op_info(op)

    fakes: dict[int, torch.Tensor] = {}  # id(cpu view) -> fakegpu tensor it stands for
    storages: dict[int, torch.UntypedStorage] = {}  # data_ptr of a fakegpu storage -> that storage
    written: list[tuple[torch.Tensor, torch.Tensor]] = []  # (fakegpu tensor, its cpu view) of mutated args
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (fakegpu out= tensor, cpu tensor computed for it)

    def convert(value, arg_name):
        if isinstance(value, torch.Tensor):
            if _is_fake(value):
                if arg_name in out_names and (outs_to_temp or value.numel() == 0):
                    # Compute into fresh CPU memory and copy into the fakegpu out tensor afterwards.
                    tmp = torch.empty(0, dtype=value.dtype)
                    outs.append((value, tmp))
                    return tmp
                view = _cpu_view(value)
                fakes[id(view)] = value
                st = value.untyped_storage()
                storages[st.data_ptr()] = st
                if arg_name in write_names:
                    written.append((value, view))
                return view
            if value.device.type == "cpu" and value.dim() > 0 and not (index_op and arg_name == "indices"):
                raise _same_device_error(f"argument {arg_name!r} in method {op_name}")
            return value
        if isinstance(value, torch.device) and value.type == NAME:
            return _CPU
        if isinstance(value, (list, tuple)):
            return type(value)(convert(v, arg_name) for v in value)
        if isinstance(value, torch.Generator) and value.device.type != NAME:
            raise RuntimeError(f"Expected a '{NAME}' device type for generator but found '{value.device.type}'")
        return value

    cpu_args = [convert(a, names[i] if i < len(names) else "") for i, a in enumerate(args)]
    cpu_kwargs = {k: convert(v, k) for k, v in kwargs.items()}
    if seeded:
        # Random ops (also those without a generator argument, like native_dropout) draw from the
        # fake device's own stream: swap it into the CPU default generator for the call.
        cpu_state = torch.get_rng_state()
        torch.set_rng_state(_generator.get_state())
        try:
            result = op(*cpu_args, **cpu_kwargs)
        finally:
            _generator.set_state(torch.get_rng_state())
            torch.set_rng_state(cpu_state)
    else:
        result = op(*cpu_args, **cpu_kwargs)

    # In-place metadata ops (t_, squeeze_, as_strided_, ...) changed the view: mirror that.
    for fake, view in written:
        if (view.size(), view.stride(), view.storage_offset()) != (fake.size(), fake.stride(), fake.storage_offset()):
            _point_at(fake, fake.untyped_storage(), view.storage_offset(), view.size(), view.stride())
    out_map = {}
    for fake, tmp in outs:
        _resize(fake, tmp.size())
        _cpu_view(fake).copy_(tmp)
        out_map[id(tmp)] = fake

    def back(value):
        if isinstance(value, torch.Tensor):
            if id(value) in fakes:
                return fakes[id(value)]  # in-place ops return self
            if id(value) in out_map:
                return out_map[id(value)]
            if value.device.type != "cpu":
                return value
            st = storages.get(value.untyped_storage().data_ptr())
            if st is not None and value.untyped_storage().nbytes() > 0:
                # A view of an input: share that input's fakegpu storage, so writes stay visible.
                return _new_fake(value.dtype, st, value.storage_offset(), value.size(), value.stride())
            return _wrap(value)
        if isinstance(value, (list, tuple)):
            return type(value)(back(v) for v in value)
        return value

    return back(result)


# ----------------------------------------------------------------------------------------------
# Ops with their own PrivateUse1 kernels
# ----------------------------------------------------------------------------------------------


def _as_cpu(t: torch.Tensor) -> torch.Tensor:
    return _cpu_view(t) if _is_fake(t) else t


def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    cpu = torch.empty(size, dtype=dtype, memory_format=memory_format or torch.contiguous_format)
    return _wrap(cpu)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return _alloc(size, stride, dtype)


def _copy_from(self, dst, non_blocking=False):
    # Reached for every copy_ that involves a fakegpu tensor (cpu<->fakegpu and fakegpu<->fakegpu).
    _as_cpu(dst).copy_(_as_cpu(self))
    return dst


def _resize(self, size, memory_format=None):
    size = list(size)
    if size == list(self.size()) and memory_format is None:
        return self  # as at::resize_: same size keeps the strides (in-place ops on views rely on it)
    numel = 1
    for s in size:
        numel *= s
    needed = (self.storage_offset() + numel) * self.element_size()
    st = self.untyped_storage()
    if needed > st.nbytes():
        # Grow into a new CPU allocation, keeping the old bytes, as a storage resize would.
        cpu = torch.empty(needed, dtype=torch.uint8)
        cpu[: st.nbytes()].copy_(_cpu_view_bytes(st))
        st = _fake_storage(cpu.untyped_storage())
    fmt = memory_format or torch.contiguous_format
    stride = torch.empty(size, device="meta", memory_format=fmt).stride() if size else ()
    _point_at(self, st, self.storage_offset(), size, stride)
    return self


def _cpu_view_bytes(fake_storage) -> torch.Tensor:
    cpu_st = torch._C._construct_storage_from_data_pointer(fake_storage.data_ptr(), _CPU, fake_storage.nbytes())
    return torch.empty(0, dtype=torch.uint8).set_(cpu_st)


def _copy_from_and_resize(self, dst):
    _resize(dst, self.size())
    return _copy_from(self, dst)


def _to_copy(self, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    # Dispatched here when the source is on fakegpu: copy on the CPU side, then place the result.
    device = torch.device(device) if device is not None else self.device
    cpu = _as_cpu(self).to(dtype=dtype or self.dtype, memory_format=memory_format or torch.preserve_format, copy=True)
    if device.type == NAME:
        return _wrap(cpu)
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


# ----------------------------------------------------------------------------------------------
# torch.fakegpu: the device module torch looks up by name (checkpointing, manual_seed, amp, ...)
# ----------------------------------------------------------------------------------------------


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
            self.device = _DEV0

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


def enable_fake_device() -> torch.device:
    """Register the ``fakegpu`` device once per process; return ``torch.device("fakegpu")``."""
    global DEVICE, _DEV0
    existing = getattr(torch, NAME, None)
    if existing is not None and getattr(existing, _MARK, False):
        DEVICE, _DEV0 = torch.device(NAME), torch.device(NAME, 0)
        return DEVICE
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", NAME):
        raise RuntimeError(f"PrivateUse1 is already taken by backend {current!r}; cannot add {NAME!r}")

    mod = _make_device_module()
    _setup_privateuseone_for_python_backend(NAME, backend_module=mod)
    DEVICE, _DEV0 = torch.device(NAME), torch.device(NAME, 0)

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
    }.items():
        impls.impl(op_name, fn, "PrivateUse1")

    # Libraries unregister their kernels when garbage collected: keep them with the device module.
    mod._libraries = (lib, impls)
    setattr(mod, _MARK, True)
    sys.modules.setdefault(f"torch.{NAME}", mod)
    return DEVICE
