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
"""

from __future__ import annotations

import torch


def travels(value) -> bool:
    """Per-element optimizer state (the scalars, e.g. a step count, stay where the optimizer keeps them)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


class ParkedOptimizerState:
    """Moves the optimizer state of a block's trained parameters between the devices."""

    def __init__(self, train_device: torch.device, temp_device: torch.device, pin: bool):
        self.train_device, self.temp_device, self.pin = train_device, temp_device, pin
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
                    state[key] = value.to(self.train_device, non_blocking=self.pin)

    @torch.no_grad()
    def park(self, parameters: list[torch.nn.Parameter]) -> None:
        """State to the temp device, into a copy kept from the last time (pinned on CUDA)."""
        for parameter, state in self._states(parameters):
            for key, value in state.items():
                if not travels(value) or value.device == self.temp_device:
                    continue
                home = self._homes.get((id(parameter), key))
                if home is None or home.shape != value.shape or home.dtype != value.dtype:
                    home = torch.empty(value.shape, dtype=value.dtype, device=self.temp_device,
                                       pin_memory=self.pin)
                    self._homes[(id(parameter), key)] = home
                home.copy_(value)  # synchronous: the train-device tensor may be freed right after
                state[key] = home


@torch.no_grad()
def write_home(current: torch.Tensor, home: torch.Tensor) -> None:
    """A stepped trained tensor's resident value into its temp-device copy (synchronously)."""
    if current.data_ptr() != home.data_ptr():  # the same memory where both devices are one
        home.copy_(current.detach())
