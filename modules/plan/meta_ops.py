"""Meta kernels run once per shape: the planner's pass repeats the same ops on the same shapes in
every block, and many of torch's meta kernels are Python (torch._refs: an elementwise add or a layer
norm takes 0.5 to 2.5 ms), so a 12B transformer's step spends most of its time in them.

An op's output on meta is a function of the op, its tensors' metadata (shape, stride, dtype,
storage offset, conj / neg bits) and its other arguments, so the first call of each such key runs
the kernel and notes its outputs' metadata; later calls get fresh empty tensors made to that note.
Only outputs that are new storages are noted (a view or an in-place op returns its input's
storage: those always run the kernel), each checked when noted to be what an empty tensor of its
shape and strides is (same storage bytes, offset 0), so a replica counts exactly the bytes the
kernel's output would. Anything else (a tensor off meta, a subclass, an argument of another kind)
runs the kernel every time. tests/test_plan_meta_pass.py compares passes with and without.

A meta tensor has no values: code in the step that reads one (`bool(mask.all())`, `.item()`) gets
an error naming the line that read it, which should ask `modules.util.torch_utils.shape_only` (or,
in transformers, `is_tracing`: traced_meta.py) and take the branch the plan counts.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# argument types whose value is the whole of what a kernel reads from them
_PLAIN = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format))
_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))  # (not subclasses that dispatch ops their own way)
_UNCACHED = object()  # the note of a key whose outputs are not all new storages
_VALUE_READ = torch.ops.aten._local_scalar_dense.default  # what bool(t), t.item(), int(t) come to


class _Uncacheable(Exception):
    pass


class MetaValueRead(RuntimeError):
    """The planner's step read a value from a meta tensor (a bug in the code that read it)."""


class MetaOpCache(TorchDispatchMode):
    """As a mode, every op under it; `run` is the same for a caller that dispatches ops itself (the
    pass's LiveBytes calls it directly: one Python mode less per op)."""

    def __init__(self):
        super().__init__()
        self._notes: dict[tuple, object] = {}
        self.hits = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # (as LiveBytes: no dynamo-disabling frame around each op; a plan compiles nothing)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.run(func, args, kwargs or {})

    def run(self, func, args, kwargs):
        if func is _VALUE_READ and args[0].is_meta:  # (a CPU tensor's value is there to read)
            raise MetaValueRead(_value_read_message(args[0]))
        key = op_key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        note = self._notes.get(key)
        if note is None:
            out = func(*args, **kwargs)
            self._notes[key] = _note(out, args, kwargs)
            return out
        if note is _UNCACHED:
            return func(*args, **kwargs)
        self.hits += 1
        return _replica(note)


def op_key(func, args, kwargs) -> tuple | None:
    """All that an op's meta kernel reads from its call (so all that its outputs' metadata, and its
    FLOPs, follow from); None where that is not known from the metadata alone (a tensor off meta)."""
    try:
        return func, _key(args), tuple(kwargs), _key(kwargs.values())
    except _Uncacheable:
        return None


def _key(values) -> tuple:
    """What the kernel reads from these arguments (a call's positional ones, or its keywords'
    values); _Uncacheable where that is not known from the metadata alone."""
    key = []
    for value in values:
        kind = type(value)
        if kind in _TENSOR_TYPES:
            if not value.is_meta or value.layout is not torch.strided:
                raise _Uncacheable
            key.append((value.shape, value.stride(), value.dtype, value.storage_offset(), value.is_conj(),
                        value.is_neg()))
        elif kind in _PLAIN:
            key.append((kind, value))
        elif kind is tuple or kind is list:
            key.append((kind, _key(value)))
        else:
            raise _Uncacheable
    return tuple(key)


def _note(out, args, kwargs):
    """The metadata to replicate `out` from, or _UNCACHED."""
    inputs = {t.untyped_storage()._cdata for t in _flat_tensors((args, kwargs))}
    single = isinstance(out, torch.Tensor)
    items = [out] if single else list(out) if isinstance(out, (tuple, list)) else None
    if items is None:
        return _UNCACHED
    seen = set()
    specs = []
    for item in items:
        if item is None:
            specs.append(None)
            continue
        if type(item) is not torch.Tensor or item.device.type != "meta":
            return _UNCACHED
        storage = item.untyped_storage()._cdata
        if storage in inputs or storage in seen or item.storage_offset() != 0:
            return _UNCACHED
        seen.add(storage)
        spec = (tuple(item.shape), item.stride(), item.dtype)
        if _make(spec).untyped_storage().nbytes() != item.untyped_storage().nbytes():
            return _UNCACHED
        specs.append(spec)
    return ("single" if single else type(out)), specs


def _make(spec) -> torch.Tensor:
    shape, stride, dtype = spec
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


def _replica(note):
    kind, specs = note
    made = [None if spec is None else _make(spec) for spec in specs]
    return made[0] if kind == "single" else kind(made)


def _flat_tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _flat_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flat_tensors(item)


def _value_read_message(tensor: torch.Tensor) -> str:
    return (f"the plan's step read the value of a meta tensor ({tuple(tensor.shape)}, {tensor.dtype}) at "
            f"{_reader()}: the planner's tensors hold no values; that code should take the branch the plan "
            f"counts where modules.util.torch_utils.shape_only(tensor) is true")


def _reader() -> str:
    """file:line of the innermost caller outside torch and this package: the code that read the value."""
    import os
    import traceback

    skipped = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(skipped):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "an unknown line"
