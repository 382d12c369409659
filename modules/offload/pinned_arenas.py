"""Parked tensors' home copies in a few large pinned arenas, as views.

torch's CUDA host allocator rounds every pinned allocation up to a power of two, so pinning each
parked tensor on its own pins up to twice its bytes (SDXL at offload 0.5: 5.9 GB pinned for
4.4 GB of weights), and pinned memory cannot be swapped out. Here the tensors are packed into
arenas whose sizes are powers of two already (nothing is rounded), largest tensors first, each
at an aligned offset of one arena; a home copy is a view into its arena.

`plan_arenas` is pure (sizes in, layout out), so a benchmark can plan real-width models on the
meta device without allocating anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from modules.util.async_devices import AsyncDevice

ALIGNMENT = 64  # bytes: a cache line, enough for every dtype's alignment and vectorised copies
LARGEST_ARENA = 1 << 30  # one allocation stays small enough to succeed on a fragmented host
SMALLEST_ARENA = ALIGNMENT  # the tail of small tensors gets arenas as small as it is


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _power_of_two_at_least(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 0).bit_length()


def _power_of_two_at_most(nbytes: int) -> int:
    return 1 << (nbytes.bit_length() - 1)


@dataclass(frozen=True)
class ArenaPlan:
    arena_bytes: list[int]  # each a power of two: what the host allocator pins for it
    placements: list[tuple[int, int]]  # per tensor, in the order given: (arena, byte offset)

    @property
    def pinned_bytes(self) -> int:
        return sum(self.arena_bytes)


def plan_arenas(sizes: list[int]) -> ArenaPlan:
    """Place tensors of `sizes` bytes into power-of-two arenas with little slack.

    Largest first, each into the first arena with room (first-fit decreasing); a new arena is the
    largest power of two the bytes still unplaced fill (at most LARGEST_ARENA), or the smallest
    that takes the tensor at hand. So the arenas follow the binary digits of the total, and the
    small tensors placed last fill the gaps the large ones leave."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    arena_bytes: list[int] = []
    used: list[int] = []
    placements: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    unplaced = sum(_aligned(s) for s in sizes)
    for index in order:
        size = _aligned(sizes[index])
        arena = next((a for a in range(len(arena_bytes)) if arena_bytes[a] - used[a] >= size), None)
        if arena is None:
            fill = min(LARGEST_ARENA, _power_of_two_at_most(max(unplaced, 1)))
            arena_bytes.append(max(fill, _power_of_two_at_least(size), SMALLEST_ARENA))
            used.append(0)
            arena = len(arena_bytes) - 1
        placements[index] = (arena, used[arena])
        used[arena] += size
        unplaced -= size
    return ArenaPlan(arena_bytes, placements)


def _arena_views(specs: list[tuple[torch.dtype, torch.Size]], capabilities: AsyncDevice
                 ) -> Iterator[tuple[int, torch.Tensor]]:
    """(i, an uninitialised pinned view of dtype and shape specs[i]), arena by arena: each arena
    is allocated only once the views of the one before have been handed out."""
    sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in specs]
    plan = plan_arenas(sizes)
    for arena_index, nbytes in enumerate(plan.arena_bytes):
        arena = capabilities.empty_pinned(nbytes)
        for i, (where, offset) in enumerate(plan.placements):
            if where == arena_index:
                dtype, shape = specs[i]
                yield i, arena[offset:offset + sizes[i]].view(dtype).view(shape)


def pinned_empty(specs: list[tuple[torch.dtype, torch.Size]], capabilities: AsyncDevice) -> list[torch.Tensor]:
    """Uninitialised pinned tensors of these (dtype, shape)s, sharing arenas."""
    homes: list[torch.Tensor | None] = [None] * len(specs)
    for i, view in _arena_views(specs, capabilities):
        homes[i] = view
    return homes


def pinned_homes(values: list[torch.Tensor | None], capabilities: AsyncDevice,
                 place: Callable[[int, torch.Tensor], None]) -> None:
    """Pinned copies of contiguous `values`, as views into arenas planned for them.

    Each is copied, its entry in `values` dropped and `place(i, home)` called (the caller points
    the tensor at its home, so the original can be freed) before the next arena is allocated:
    host memory peaks near the part plus one arena, not plus all of them."""
    for i, home in _arena_views([(v.dtype, v.shape) for v in values], capabilities):
        home.copy_(values[i].detach())
        values[i] = None
        place(i, home)
