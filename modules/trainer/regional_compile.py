"""Regional compile: torch.compile each of a part's repeated blocks instead of the whole part.

A diffusion model is a few block types repeated many times. Compiling the blocks (the family's
`checkpoint_blocks(part)`, the list checkpointing and offloading share) compiles each block type
once and reuses its graph for every repeat, so the first step waits for a fraction of a
whole-model compile; this is what diffusers' `compile_repeated_blocks` and OneTrainer's compile
option do. Each block's forward hooks (the adapters) are inside its compiled call.
`dynamic=True`: one graph serves every bucket resolution, batch size and block width, instead of a
recompile per shape, which would soon hit dynamo's recompile limit and fall back to eager.
A part whose family lists no blocks is compiled whole.
"""

from __future__ import annotations

from torch import nn

# tests set "aot_eager": the same dynamo and autograd graphs, without inductor's code generation
BACKEND = "inductor"


def compile_regions_(part: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Compile (lazily, on first call) each block of `part`, or `part` itself without blocks;
    returns the modules that were compiled."""
    targets = list(blocks) or [part]
    for module in targets:
        module.compile(dynamic=True, backend=BACKEND)
    return targets
