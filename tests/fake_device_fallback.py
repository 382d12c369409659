"""The boxed fallback of the fakegpu device: every aten op without its own kernel runs on CPU views."""

from __future__ import annotations

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from fake_device_tensors import (
    _CPU, NAME, _cpu_view, _generator, _is_fake, _new_fake, _point_at, _resize, _same_device_error, _wrap,
)

# CUDA lets CPU index tensors join a device tensor in advanced indexing.
_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_", "aten::_unsafe_index"}


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

# The dtype torch stores a wrapped number in (a Python scalar an op took as a Tensor, as `x % 2` does)
_WRAPPED_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def _takes_a_tensor(argument) -> bool:
    kind = argument.type
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    return isinstance(kind, torch.TensorType)


def _number_as_tensor(value, tensors) -> torch.Tensor:
    """A wrapped number as the 0-dim CPU tensor that computes what the number did.

    A wrapped number never sets the dtype within its kind (float16 0-dim % 0.7 stays float16), a
    0-dim tensor does: so it takes the dtype the op's tensors promote to with it. Stored first as
    torch does (0.1 as float64), then cast as the kernel casts it (no float32 rounding on the way)."""
    stored = torch.tensor(value, dtype=_WRAPPED_DTYPES[type(value)])
    if not tensors:
        return stored
    return stored.to(elementwise_dtypes(*tensors, value, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1])


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
            {a.name for a in args if _takes_a_tensor(a)},
            schema.name in _INDEX_OPS,
            torch.Tag.nondeterministic_seeded in op.tags,
        )
        _op_info_cache[op] = info
    return info


def _run_on_cpu(op, args, kwargs, outs_to_temp: bool):
    op_name, names, out_names, write_names, tensor_names, index_op, seeded = _op_info(op)

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
        if arg_name in tensor_names and type(value) in _WRAPPED_DTYPES:
            # Boxing into Python turned a wrapped-number tensor back into a number, which the op's
            # Tensor argument refuses: a 0-dim CPU tensor again (CPU scalars may join device tensors).
            inputs = [v for n, v in named if n in tensor_names and n not in out_names and isinstance(v, torch.Tensor)]
            return _number_as_tensor(value, inputs)
        if isinstance(value, (list, tuple)):
            return type(value)(convert(v, arg_name) for v in value)  # noqa: F821 (itself; deleted after use to break the cycle)
        if isinstance(value, torch.Generator) and value.device.type != NAME:
            raise RuntimeError(f"Expected a '{NAME}' device type for generator but found '{value.device.type}'")
        return value

    named = [*zip(names, args), *kwargs.items()]
    cpu_args = [convert(a, names[i] if i < len(names) else "") for i, a in enumerate(args)]
    cpu_kwargs = {k: convert(v, k) for k, v in kwargs.items()}
    # convert and back below call themselves: each is a reference cycle through its own cell, holding
    # the op's fakegpu tensors (fakes, storages, outs) until the garbage collector runs, so memory
    # counted live stayed up after every op (79 MiB of a tiny UNet's step); deleting them breaks it
    del convert
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
            return type(value)(back(v) for v in value)  # noqa: F821 (itself; deleted after use to break the cycle)
        return value

    try:
        return back(result)
    finally:
        del back
