"""Which parked blocks are on the train device when each block runs: the conductor's schedule.

Blocks run in execution order in the forward pass and in reverse in the backward pass (with
gradient checkpointing each block is recomputed right before its own backward). One rule for
every pass: while a block runs, the parked blocks on the train device are the first WINDOW parked
blocks among those still to run, counting from the running block through the rest of this pass
and on into the pass that follows it. The first is the one that must be there; the second is
being prefetched. So at least two layers are resident (DESIGN.md), a block leaves as soon as
the passes have moved past it, and nothing leaves only to come straight back at a pass boundary.

What follows each pass:
- forward-then-backward (a training step's forward): the backward, from the last block down;
- forward-only (sampling, caching, validation): another forward from the first block;
- backward: the next training step's forward, from the first block.
"""

from __future__ import annotations

from enum import Enum

WINDOW = 2


class Pass(str, Enum):
    FORWARD_THEN_BACKWARD = "forward-then-backward"
    FORWARD_ONLY = "forward-only"
    BACKWARD = "backward"


def _still_to_run(blocks: int, block: int, kind: Pass) -> list[int]:
    forward_from = lambda start: list(range(start, blocks))  # noqa: E731
    backward_from = lambda start: list(range(start, -1, -1))  # noqa: E731
    if kind is Pass.BACKWARD:
        return backward_from(block) + forward_from(0)
    if kind is Pass.FORWARD_ONLY:
        return forward_from(block) + forward_from(0)
    return forward_from(block) + backward_from(blocks - 1)


def resident_when_running(blocks: int, parked: list[int], block: int, kind: Pass) -> tuple[int, ...]:
    """The parked blocks on the train device while `block` runs in a pass of `kind`."""
    parked_set = set(parked)
    ahead = [b for b in dict.fromkeys(_still_to_run(blocks, block, kind)) if b in parked_set]
    return tuple(sorted(ahead[:WINDOW]))


def resident_after(blocks: int, parked: list[int], kind: Pass) -> tuple[int, ...]:
    """The parked blocks left on the train device when a pass of `kind` has finished."""
    following = Pass.BACKWARD if kind is Pass.FORWARD_THEN_BACKWARD else Pass.FORWARD_ONLY
    start = blocks - 1 if following is Pass.BACKWARD else 0
    return resident_when_running(blocks, parked, start, following) if blocks else ()


def schedule_table(blocks: int, parked: list[int], kind: Pass) -> list[tuple[int, tuple[int, ...]]]:
    """(block, parked blocks resident while it runs) for each block in the order the pass runs them,
    then (-1, resident after the pass). The conductor follows this; tests read it as a table."""
    order = range(blocks - 1, -1, -1) if kind is Pass.BACKWARD else range(blocks)
    rows = [(block, resident_when_running(blocks, parked, block, kind)) for block in order]
    return rows + [(-1, resident_after(blocks, parked, kind))]


def choose_parked(block_bytes: list[int], fraction: float) -> list[int]:
    """The blocks to park so that at least `fraction` of all block bytes is parked: the fewest
    evenly spaced blocks that reach it. Parked neighbours would have to arrive back to back;
    spread out, each one's transfer overlaps the compute of the resident blocks before it."""
    total, count = sum(block_bytes), len(block_bytes)
    if fraction <= 0 or total == 0:
        return []
    for k in range(1, count + 1):
        chosen = sorted({int((i + 0.5) * count / k) for i in range(k)})
        if sum(block_bytes[i] for i in chosen) >= fraction * total - 1e-9:
            return chosen
    return list(range(count))
