"""Which parked blocks are on the train device when each block runs: the conductor's schedule.

Blocks run in execution order in the forward pass and in reverse in the backward pass (with
gradient checkpointing each block is recomputed right before its own backward). One rule for
every pass: while a block runs, the parked blocks on the train device are the first WINDOW parked
blocks among those still to run, counting from the running block through the rest of this pass
and on into the pass that follows it. The first is the one that must be there; the others (the
prefetch depth, `offload_prefetch`, 1 by default) are being prefetched. So at least two layers
are resident (docs/memory-and-offload.md), a block leaves as soon as the passes have moved past it, and nothing
leaves only to come straight back at a pass boundary.

What follows each pass:
- forward-then-backward (a training step's forward): the backward, from the last block down;
- forward-only (sampling, caching, validation): another forward from the first block;
- backward: the next training step's forward, from the first block.
"""

from __future__ import annotations

from enum import Enum

DEFAULT_PREFETCH = 1
WINDOW = 1 + DEFAULT_PREFETCH  # the block needed now and those prefetched after it
SHORT_ENOUGH = 1e-4  # of all block bytes: how far below the target a layout still counts as parking it
TOLERANCE = 0.01  # of all block bytes: how far past the target a layout may park before it is corrected


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


def resident_when_running(blocks: int, parked: list[int], block: int, kind: Pass,
                          window: int = WINDOW) -> tuple[int, ...]:
    """The parked blocks on the train device while `block` runs in a pass of `kind`; `window`: the
    needed block plus the prefetch depth."""
    parked_set = set(parked)
    ahead = [b for b in dict.fromkeys(_still_to_run(blocks, block, kind)) if b in parked_set]
    return tuple(sorted(ahead[:window]))


def resident_after(blocks: int, parked: list[int], kind: Pass, window: int = WINDOW) -> tuple[int, ...]:
    """The parked blocks left on the train device when a pass of `kind` has finished."""
    following = Pass.BACKWARD if kind is Pass.FORWARD_THEN_BACKWARD else Pass.FORWARD_ONLY
    start = blocks - 1 if following is Pass.BACKWARD else 0
    return resident_when_running(blocks, parked, start, following, window) if blocks else ()


def schedule_table(blocks: int, parked: list[int], kind: Pass,
                   window: int = WINDOW) -> list[tuple[int, tuple[int, ...]]]:
    """(block, parked blocks resident while it runs) for each block in the order the pass runs them,
    then (-1, resident after the pass). The conductor follows this; tests read it as a table."""
    order = range(blocks - 1, -1, -1) if kind is Pass.BACKWARD else range(blocks)
    rows = [(block, resident_when_running(blocks, parked, block, kind, window)) for block in order]
    return rows + [(-1, resident_after(blocks, parked, kind, window))]


def bytes_in_flight(block_bytes: list[int], parked: list[int], window: int = WINDOW) -> int:
    """The most parked-block bytes on the train device at once, over a training step's two passes
    and a forward-only pass: what layer offloading adds to the resident blocks' memory."""
    return max((sum(block_bytes[b] for b in resident)
                for kind in Pass for _, resident in schedule_table(len(block_bytes), parked, kind, window)),
               default=0)


def choose_parked(block_bytes: list[int], fraction: float, window: int = WINDOW) -> list[int]:
    """The blocks to park: at least `fraction` of all block bytes (the traffic a pass moves), as
    little more as the block sizes allow, spread so the bytes parked keep pace with the bytes run.

    Walking the blocks in execution order, a block is parked when that brings the bytes parked so
    far closer to `fraction` of the bytes passed so far (error diffusion). Each parked block's
    transfer then overlaps the compute of resident blocks of about the same share of bytes
    everywhere in the stack, and runs of big parked blocks only occur where nothing smaller is left
    to park. Sizes far apart (SDXL's six 10-layer transformer blocks hold 85% of its bytes) can leave
    the walk a block off the target; single additions, removals and swaps then bring it back, the
    least overshoot first and, among equals, the layout whose busiest prefetch window is lightest,
    then the one whose parked blocks sit least close together."""
    count, total = len(block_bytes), sum(block_bytes)
    if fraction <= 0 or total == 0:
        return []
    if fraction >= 1:
        return list(range(count))
    # (a hair short counts as reached: T5's first block is 4 KiB bigger than the others for its
    # position bias, and those 4 KiB must not cost a whole block more, 54% parked instead of 50%)
    target = fraction * total - SHORT_ENOUGH * total
    parked, passed, chosen = 0, 0, set()
    for index, size in enumerate(block_bytes):
        passed += size
        if parked + size / 2 < fraction * passed:
            chosen.add(index)
            parked += size
    return sorted(_corrected(block_bytes, chosen, target, window))


def _corrected(block_bytes: list[int], chosen: set[int], target: float, window: int) -> set[int]:
    """`chosen` moved to at least `target` bytes, then to within TOLERANCE of it where it can be."""
    slack = TOLERANCE * sum(block_bytes)
    for _ in range(2 * len(block_bytes)):  # each move strictly improves; this bounds a bad case
        parked = sum(block_bytes[i] for i in chosen)
        if parked >= target and parked - target <= slack:
            break
        free = [i for i in range(len(block_bytes)) if i not in chosen]
        if parked < target:
            moves = [(frozenset(), frozenset([q])) for q in free]
        else:
            moves = [(frozenset([p]), frozenset(q)) for p in chosen for q in ([], *([i] for i in free))]
        scored = []
        for out, into in moves:
            after = parked - sum(block_bytes[i] for i in out) + sum(block_bytes[i] for i in into)
            # short of the target: the most bytes; past it: the least overshoot
            scored.append(((after < target, abs(after - target)), out, into))
        best = min(s[0] for s in scored)
        if parked >= target and best >= (False, parked - target):
            break  # no move gets closer
        ties = [(chosen - out) | into for key, out, into in scored if key == best]
        chosen = min(ties, key=lambda c: (bytes_in_flight(block_bytes, sorted(c), window),
                                          _crowding(block_bytes, sorted(c)), sorted(c)))
    return chosen


def _crowding(block_bytes: list[int], parked: list[int]) -> float:
    """Large where parked blocks sit close together: their transfers then queue behind each other."""
    return sum((block_bytes[a] + block_bytes[b]) / (b - a) for a, b in zip(parked, parked[1:]))

