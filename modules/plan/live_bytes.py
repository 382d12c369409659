"""Live bytes on one device during a pass of fake tensors: each new storage an op puts there counts
once, from the op that made it until its last tensor goes (a weakref on the storage says when).
Storages that existed before (weights, buffers, adapters) are registered first, so a view of a
weight (a transpose, a reshape) is not counted as new memory.

The same mode counts FLOPs with torch.utils.flop_counter's formulas (its `flop_registry`), not
with FlopCounterMode itself: that mode's module tracker hangs closures on the autograd graph
that sit in reference cycles with the activations, so they would live (and count) until the
garbage collector ran: 6.5 GiB instead of 0.74 for FLUX.1 at 512 px. A formula's FLOPs follow from
its arguments' shapes alone, so on meta each is worked out once per op and metadata (meta_ops.op_key:
a VAE's convolutions repeat in every block and tile); a pass that needs no FLOPs (the caching and
sampling phases) counts none.

A copy to another device, which a meta tensor cannot make (activation offloading's to the CPU), is
made on meta by `copy_elsewhere` and never counted: its bytes have left the counted device. Its copy
back is a new storage there, and counts.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from modules.plan.meta_ops import op_key


class LiveBytes(TorchDispatchMode):
    """`run(func, args, kwargs)`: what runs each op (default: the op itself, through the modes
    below this one). `flops`: count them too."""

    def __init__(self, device: torch.device, run=None, flops: bool = True):
        super().__init__()
        self.device = device
        self._run = run
        self._formulas = flop_registry if flops else {}
        self._flops_of: dict[tuple, int] = {}
        self.live = 0
        self.peak = 0
        self.flops = 0
        self._seen: dict[int, weakref.ref] = {}
        self._elsewhere = False

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo-disabling frame unless this says
        # False: four eval-frame switches per op, ~10% of a pass; nothing in a plan compiles
        return False

    def known(self, tensors) -> None:
        """Storages that are not the pass's (weights, buffers, trained tensors): never counted."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self._seen.setdefault(id(storage), weakref.ref(storage))

    def copy_elsewhere(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of `tensor` (on the counted device) that stands for its copy on `device`: a tensor
        of the counted device, with the strides `tensor.to(device)` gives, whose storage is not counted
        (checkpointing.py's `temp_copy`)."""
        assert tensor.device == self.device and device != self.device, (tensor.device, device)
        self._elsewhere = True
        try:
            copy = tensor.to(self.device, copy=True)
        finally:
            self._elsewhere = False
        self.known([copy])
        return copy

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs) if self._run is None else self._run(func, args, kwargs)
        formula = self._formulas.get(func.overloadpacket)
        if formula is not None:
            self.flops += self._op_flops(formula, func, args, kwargs, out)
        for tensor in () if self._elsewhere else _tensors(out):
            if tensor.device == self.device:
                self._count(tensor.untyped_storage())
        return out

    def _op_flops(self, formula, func, args, kwargs, out) -> int:
        key = op_key(func, args, kwargs)
        if key is None:
            return formula(*args, **kwargs, out_val=out)
        flops = self._flops_of.get(key)
        if flops is None:
            flops = self._flops_of[key] = formula(*args, **kwargs, out_val=out)
        return flops

    def _count(self, storage) -> None:
        key = id(storage)
        ref = self._seen.get(key)
        if ref is not None and ref() is storage:
            return
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)

        def gone(_ref, size=size, key=key):
            self.live -= size
            if self._seen.get(key) is _ref:
                del self._seen[key]

        self._seen[key] = weakref.ref(storage, gone)


def _tensors(out):
    """The tensors of an op's output (a tensor, or tuples and lists of them). Not torch's
    tree_flatten: its recursive helper is a closure in a reference cycle that holds the leaves, so
    every output it saw would live until the garbage collector ran, and count as live."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _tensors(item)
