"""Gradient checkpointing per block, non-reentrant, with optional activation offloading.

The blocks are the family's `checkpoint_blocks(part)`, the same list the layer offloader parks,
so every parked block is recomputed right before its own backward and its layers are on the
train device for both. The model libraries' own checkpointing is not used for this: diffusers
checkpoints a UNet's resnets but not its first mid-block resnet or its attention blocks as a
whole, and a parked block that is not recomputed would need its layers back in the middle of
the backward pass. `use_reentrant=False`: the reentrant variant drops gradients of inputs that
do not require grad and cannot nest.

With activation offloading the block's inputs (what the checkpoint keeps) wait on the temp device
until the backward pass recomputes the block; that works with or without layer offloading. Every
tensor input counts: positional, keyword (diffusers calls transformer blocks with
`hidden_states=...`) and inside tuples, lists and dicts (Flux's rotary `(cos, sin)`). A tensor
handed to several blocks (a time embedding, rotary tables) is copied once and the copy shared.
The forward itself computes from the original inputs, so it never waits for a copy, and its
autograd graph (what the gradients flow through) starts at them; the copies only feed the
recomputation. From CUDA to the CPU the copy goes into pinned memory on a side stream, ordered
after the compute that made the input; the recomputation's stream waits on its event before
copying it back. Elsewhere copies are plain synchronous ones. Under torch.compile (regional
compile traces the checkpoint) the function must be free of side effects, so there the forward
brings the copies back too, as autograd-followed copies.

`temp_copy(tensor, temp_device)`, where given, makes each synchronous copy instead of
`tensor.to(temp_device)`: the planner's pass on meta tensors (which cannot go to the CPU) makes there
a meta tensor that stands for the copy and that it does not count on the train device
(modules/plan/live_bytes.py `LiveBytes.copy_elsewhere`); everything else is this same path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

_side_streams: dict[torch.device, torch.cuda.Stream] = {}
# input tensor -> (its version when copied, the copy): blocks given the same tensor share one copy
_copies = WeakTensorKeyDictionary()


class _Parked:
    """A tensor's copy on the temp device: where it goes back to, the event its copy out finishes on
    (None: a synchronous copy), and whether the original required grad."""

    def __init__(self, copy: torch.Tensor, original: torch.Tensor, ready: torch.cuda.Event | None):
        self.copy, self.home, self.ready, self.grad = copy, original.device, ready, original.requires_grad

    def restore(self, copy: torch.Tensor) -> torch.Tensor:
        """`copy`: this one's copy as the checkpoint hands it back."""
        if self.ready is not None:
            torch.cuda.current_stream(self.home).wait_event(self.ready)
        # (copy=True: a new tensor at home even where a stand-in copy sits on that device, as in the plan)
        back = copy.to(self.home, non_blocking=self.ready is not None, copy=True)
        # as in the forward: an input that needs no grad makes its ops save fewer tensors, and the
        # checkpoint refuses a recomputation that saves a different number
        return back.requires_grad_(self.grad)


def _copy_async_to_pinned(tensor: torch.Tensor) -> _Parked:
    stream = _side_streams.get(tensor.device)
    if stream is None:
        stream = _side_streams[tensor.device] = torch.cuda.Stream(tensor.device)
    stream.wait_stream(torch.cuda.current_stream(tensor.device))  # after the compute that wrote it
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        copy.copy_(tensor.detach(), non_blocking=True)
    tensor.record_stream(stream)  # its memory is not reused before the copy has read it
    ready = torch.cuda.Event()
    ready.record(stream)
    return _Parked(copy, tensor, ready)


TempCopy = Callable[[torch.Tensor, torch.device], torch.Tensor]


def _copied_to(tensor: torch.Tensor, offload_to: torch.device) -> torch.Tensor:
    return tensor.to(offload_to)


def _park(tensor: torch.Tensor, offload_to: torch.device, temp_copy: TempCopy | None) -> _Parked:
    known = _copies.get(tensor)
    if known is not None and known[0] == tensor._version:
        return known[1]
    if temp_copy is None and tensor.device.type == "cuda" and offload_to.type == "cpu":
        parked = _copy_async_to_pinned(tensor)
    else:
        parked = _Parked((temp_copy or _copied_to)(tensor.detach(), offload_to), tensor, None)
    _copies[tensor] = (tensor._version, parked)
    return parked


def checkpointed_call(function: Callable, *args, offload_to: torch.device | None = None,
                      temp_copy: TempCopy | None = None, **kwargs):
    """`function(*args, **kwargs)` under non-reentrant checkpointing; with `offload_to`, the tensors
    the checkpoint keeps (the block's inputs, wherever in args and kwargs) wait there and come back
    for the recomputation (each copy made by `temp_copy` where given: the module's docstring)."""
    leaves, layout = tree_flatten((args, kwargs))
    moved = [offload_to is not None and isinstance(v, torch.Tensor) and v.device != offload_to for v in leaves]
    # a tensor on the train device among the checkpoint's positional inputs, the only ones it reads
    # to decide whose random state (dropout) to save for the recomputation: a block called with
    # keywords, or with every input offloaded, would otherwise get a different dropout mask there
    marker = next((v.new_empty(0) for v in leaves if isinstance(v, torch.Tensor) and v.device.type != "cpu"), None)
    if not any(moved):
        def run(_marker, *held):
            call_args, call_kwargs = tree_unflatten(list(held), layout)
            return function(*call_args, **call_kwargs)

        return torch.utils.checkpoint.checkpoint(run, marker, *leaves, use_reentrant=False)
    if torch.compiler.is_compiling():
        return _traced_offloaded_call(function, leaves, layout, moved, marker, offload_to)
    parked = [_park(v, offload_to, temp_copy) if m else v for v, m in zip(leaves, moved)]
    # the forward gets the originals (handed over once, so nothing here keeps them alive after it)
    first_call = [leaves]

    def run(_marker, *held):
        if first_call:
            values = first_call.pop()
        else:
            values = [p.restore(h) if isinstance(p, _Parked) else h for p, h in zip(parked, held)]
        call_args, call_kwargs = tree_unflatten(values, layout)
        return function(*call_args, **call_kwargs)

    held = [p.copy if isinstance(p, _Parked) else p for p in parked]  # what the checkpoint keeps
    return torch.utils.checkpoint.checkpoint(run, marker, *held, use_reentrant=False)


def _traced_offloaded_call(function, leaves, layout, moved, marker, offload_to):
    """Under torch.compile, where the checkpointed function may have no side effects (handing the
    originals over once is one): plain copies that autograd follows, brought back in both passes."""
    homes = [v.device if m else None for v, m in zip(leaves, moved)]

    def run(_marker, *held):
        values = [h.to(home) if home is not None else h for h, home in zip(held, homes)]
        call_args, call_kwargs = tree_unflatten(values, layout)
        return function(*call_args, **call_kwargs)

    held = [v.to(offload_to) if m else v for v, m in zip(leaves, moved)]
    return torch.utils.checkpoint.checkpoint(run, marker, *held, use_reentrant=False)


def checkpoint_blocks_(blocks: list[nn.Module], offload_to: torch.device | None = None,
                       temp_copy: TempCopy | None = None) -> None:
    """Make each block recompute its forward in the backward pass (when grad is enabled); with
    `offload_to`, its inputs wait there (copied by `temp_copy` where given: the module's docstring)."""
    for block in blocks:
        original = block.forward  # the bound forward; calling it skips the wrapper below

        def forward(*args, _original=original, **kwargs):
            if torch.is_grad_enabled():
                return checkpointed_call(_original, *args, offload_to=offload_to, temp_copy=temp_copy, **kwargs)
            return _original(*args, **kwargs)

        block.forward = forward
