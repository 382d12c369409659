"""Each process's share of a global batch (data parallel, modules/trainer/distributed.py).

The epoch order is built for the global batch (batch_size x processes, one bucket per batch); rank r
trains the contiguous slice [r*k, (r+1)*k) of it, k = ceil(n / processes), so a full batch splits
evenly and a short last batch of a bucket leaves the last ranks less, or nothing. A rank with
nothing trains the batch's first sample with weight 0: it draws the same random numbers as the
others (their generators stay in step) and adds zero gradients to the average.
"""

from __future__ import annotations

from typing import NamedTuple


class Share(NamedTuple):
    indices: list[int]  # what this rank trains
    first: int  # their position in the global batch (where per-sample random streams start)
    weight: float  # this rank's part of the global batch's mean loss: len(share) / len(batch)


def batch_share(indices: list[int], rank: int, world: int) -> Share:
    if world == 1:
        return Share(indices, 0, 1.0)
    size = -(-len(indices) // world)
    first = min(rank * size, len(indices))
    mine = indices[first:first + size]
    if not mine:
        return Share(indices[:1], 0, 0.0)
    return Share(mine, first, len(mine) / len(indices))
