"""Tensors of a frozen part that wait on the temp device in home copies made once, and visit the
train device only while the part runs (an idle part's non-block layers: trainer/idle_parts.py).

As for the conductor's parked blocks, the homes are pinned where the train device is async (plain
contiguous tensors in pinned arenas, pinned_arenas.py; a tensor subclass pinned on its own), so
the copies to the device are fast (they are plain copies: a visit is rare), and a visit ends by pointing each tensor back at its
home: nothing is copied back (the part is frozen), and no host memory is allocated again.
A tensor two layers share (tied weights) gets one home and one device copy.
"""

from __future__ import annotations

import torch

from modules.offload.layer_tensors import LayerTensor, tensor_bytes
from modules.offload.pinned_arenas import pinned_homes
from modules.util.async_devices import async_device


class HomeCopies:
    def __init__(self, tensors: list[LayerTensor], train_device: torch.device, temp_device: torch.device):
        self.train_device, self.temp_device = torch.device(train_device), torch.device(temp_device)
        self.kit = async_device(self.train_device)
        self.pin = self.kit is not None and self.temp_device.type == "cpu"
        groups: dict[int, list[LayerTensor]] = {}
        for tensor in tensors:
            groups.setdefault(id(tensor.get()), []).append(tensor)
        self._groups = list(groups.values())  # the layers that hold one tensor
        self._homes: list[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return sum(tensor_bytes(group[0].get()) for group in self._groups)

    def _put(self, index: int, value: torch.Tensor) -> None:
        for tensor in self._groups[index]:
            tensor.put(value)

    def send_home(self) -> None:
        """Every tensor onto its home (made by the first call: the tensors are copied there once)."""
        if self._homes is not None:
            for index, home in enumerate(self._homes):
                self._put(index, home)
            return
        homes: list[torch.Tensor | None] = [None] * len(self._groups)

        def place(index: int, home: torch.Tensor) -> None:
            self._put(index, home)
            homes[index] = home

        values = [group[0].get().detach() for group in self._groups]
        in_arena = [i for i, v in enumerate(values) if self.pin and type(v) is torch.Tensor and v.is_contiguous()]
        if in_arena:
            pinned_homes([values[i] for i in in_arena], self.kit, lambda k, home: place(in_arena[k], home))
        for index, value in enumerate(values):
            if homes[index] is None:  # a tensor subclass (torchao), or no pinning: a copy of its own
                home = value.to(self.temp_device)
                place(index, self.kit.pin(home) if self.pin and home.device.type == "cpu" else home)
        self._homes = homes

    def bring(self) -> None:
        """Every tensor onto the train device (a copy of its home, freed when it goes home again)."""
        for index, home in enumerate(self._homes):
            self._put(index, home.to(self.train_device))
