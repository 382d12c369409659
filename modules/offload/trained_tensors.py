"""Trained tensors in parked blocks (a full fine-tune with layer offloading): their updates go home,
and their optimizer state travels with them.

The conductor keeps each parked tensor's copy on the temp device ("home") and parks a block by
pointing its tensors back at that copy. For frozen weights the copy never goes stale; a trained
weight is stepped on the train device while its block is resident (the fused backward steps it in
its post-accumulate-grad hook, in the block's backward), so the resident value is the only
up-to-date one. Pointing the parameter back at the old home would drop the step (the classic
offloading bug: the optimizer stepped a copy). So a block that may have been stepped writes its
trained tensors into their home before it leaves.

Where the optimizer state lives: with the weights. A parked block's per-element state (AdamW's
two moments, an 8-bit optimizer's quantized moments and scales) waits on the temp device and is
brought to the train device only for the block's backward pass, where the step runs; so the
train device holds the state of the resident window, not of the model, and offloading shrinks
state as much as weights (AdamW's float32 state is twice the weights). The step itself runs on
the train device, as OneTrainer's does: stepping on the host would need every gradient moved
there and a CPU optimizer over the whole model. Scalar state (AdamW's `step` count) stays where
the optimizer keeps it.

Where the train device has streams, both write-backs are asynchronous: the conductor issues them
on its side stream (after the compute stream's step), records an event, and copies out of a home
(or lets the host read it) only after that event; the device tensors they read are recorded on
the side stream, so their memory is not reused before the copy has read it.
"""

from __future__ import annotations

import torch

from modules.offload.pinned_arenas import pinned_empty
from modules.util.async_devices import AsyncDevice


def travels(value) -> bool:
    """Per-element optimizer state (the scalars, e.g. a step count, stay where the optimizer keeps them)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


class ParkedOptimizerState:
    """Moves the optimizer state of a block's trained parameters between the devices."""

    def __init__(self, train_device: torch.device, temp_device: torch.device, pinned: AsyncDevice | None):
        """pinned: the train device's streams and pinned memory where the state parks in pinned
        host memory and moves asynchronously; None: plain synchronous copies."""
        self.train_device, self.temp_device, self.pinned = train_device, temp_device, pinned
        self.optimizer: torch.optim.Optimizer | None = None
        self._homes: dict[tuple[int, str], torch.Tensor] = {}  # (parameter id, key) -> its temp copy

    def _states(self, parameters: list[torch.nn.Parameter]):
        if self.optimizer is None:
            return
        for parameter in parameters:
            state = self.optimizer.state.get(parameter)  # .get: never create an empty entry
            if state:
                yield parameter, state

    @torch.no_grad()
    def bring(self, parameters: list[torch.nn.Parameter]) -> None:
        """State to the train device (the block is about to be stepped)."""
        for _, state in self._states(parameters):
            for key, value in state.items():
                if travels(value) and value.device != self.train_device:
                    state[key] = value.to(self.train_device, non_blocking=self.pinned is not None)

    @torch.no_grad()
    def park(self, parameters: list[torch.nn.Parameter]) -> None:
        """State to the temp device, into a copy kept from the last time (pinned where it can be:
        a block's new copies share arenas). With streams, issued on the current (side) stream."""
        moving = []
        for parameter, state in self._states(parameters):
            for key, value in state.items():
                if travels(value) and value.device != self.temp_device:
                    moving.append((parameter, state, key, value))
        fresh = [m for m in moving if not self._fits(self._homes.get((id(m[0]), m[2])), m[3])]
        if self.pinned is not None and fresh:
            homes = pinned_empty([(v.dtype, v.shape) for *_, v in fresh], self.pinned)
            for (parameter, _, key, _), home in zip(fresh, homes):
                self._homes[(id(parameter), key)] = home
        for parameter, _, key, value in fresh:
            if self.pinned is None:
                self._homes[(id(parameter), key)] = torch.empty(value.shape, dtype=value.dtype, device=self.temp_device)
        for parameter, state, key, value in moving:
            home = self._homes[(id(parameter), key)]
            if self.pinned is None:
                home.copy_(value)  # synchronous: the train-device tensor may be freed right after
            else:
                home.copy_(value, non_blocking=True)
                value.record_stream(self.pinned.streams.current_stream(self.train_device))
            state[key] = home

    @staticmethod
    def _fits(home: torch.Tensor | None, value: torch.Tensor) -> bool:
        return home is not None and home.shape == value.shape and home.dtype == value.dtype


@torch.no_grad()
def write_home(current: torch.Tensor, home: torch.Tensor, stream=None) -> None:
    """A stepped trained tensor's resident value into its temp-device copy: synchronously, or
    with `stream` (the current side stream) asynchronously, for the caller to wait on."""
    if current.data_ptr() == home.data_ptr():  # the same memory where both devices are one
        return
    if stream is None:
        home.copy_(current.detach())
    else:
        home.copy_(current.detach(), non_blocking=True)
        current.record_stream(stream)
