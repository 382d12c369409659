"""Which weights of a text encoder reach the conditioning the family reads, found by walking the
autograd graph of one real encoding (no backward, no gradient memory).

A family that reads a penultimate hidden state (SDXL's CLIP-L) never uses the encoder's last
layer nor its final layer norm; a fine-tune that trained them would have the first-step guard fire
on weights that rightly get no gradient. The family declares its penultimate block for adapters
(unreachable_prefixes), but a norm or projection after it is not a block: the graph says exactly.
"""

from __future__ import annotations

import torch
from torch import nn


def graph_parameters(outputs: list[torch.Tensor]) -> set[int]:
    """ids of the leaf tensors (parameters) the outputs were computed from."""
    found, seen = set(), set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def reachable_text_weights(family, part: str) -> set[int]:
    """ids of the `part` parameters that the family's encode_text output depends on."""
    module: nn.Module = family.parts[part]
    wanted = [p for p in module.parameters()]
    kept = [p.requires_grad for p in wanted]
    try:
        for p in wanted:
            p.requires_grad_(True)
        with torch.enable_grad():
            outputs = family.encode_text(family.tokenize(["a photo"]))
        return graph_parameters([t for t in outputs.values() if isinstance(t, torch.Tensor)])
    finally:
        for p, flag in zip(wanted, kept):
            p.requires_grad_(flag)
