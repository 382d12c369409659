"""OFT (LyCORIS "diag-oft", what ComfyUI and Forge load): a block-diagonal orthogonal rotation of
the layer's output channels, W' = blockdiag(R_k^T) W, the bias left as it is.

Each block R_k is the Cayley transform of a skew-symmetric Q_k = B_k - B_k^T of the stored
`oft_blocks` B (block_num, block_size, block_size): R = (I + Q)(I - Q)^-1, orthogonal for any B,
and the identity at B = 0, where a fresh adapter starts. R^T is solved for, not inverted:
(I + Q) R^T = (I - Q). `alpha` is the optional norm constraint on Q (0: none), with ComfyUI's
meaning (||Q|| is clipped to alpha).

peft's OFT rotates the layer's input features instead (y = W R x); the block math is the same,
the side differs, so the two file layouts do not convert into each other.
Rank dropout keeps a block unrotated with that probability; dropout acts on the change of the
output; module dropout skips the adapter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modules.adapters.base import AdapterModule


def block_size_for(dimension: int, wanted: int) -> int:
    """The largest divisor of `dimension` not above `wanted` (blocks must tile the channels)."""
    return max(d for d in range(1, min(wanted, dimension) + 1) if dimension % d == 0)


class OFTModule(AdapterModule):
    algorithm = "oft"

    def __init__(self, name: str, base: nn.Module, block_size: int, dropout: float = 0.0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 rank_dropout: float = 0.0, module_dropout: float = 0.0, constraint: float = 0.0):
        super().__init__(name, base, dropout=dropout, rank_dropout=rank_dropout, module_dropout=module_dropout)
        size = block_size_for(self.out_dim, block_size)
        if size < 2:
            raise ValueError(f"adapter.oft_block_size: its {self.out_dim} output channels have no divisor "
                             f"between 2 and {block_size} to make rotation blocks of")
        self.block_size, self.block_num = size, self.out_dim // size
        self.oft_blocks = nn.Parameter(torch.zeros(self.block_num, size, size, device=device, dtype=dtype))
        self.register_buffer("alpha", torch.tensor(float(constraint), device=device), persistent=True)
        self._refresh_constraint()
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh_constraint())

    def _refresh_constraint(self) -> None:
        # a Python float, read once, so the forward never syncs on it
        self.constraint = float(self.alpha)

    def rotation_t(self, training: bool = False) -> torch.Tensor:
        """R_k^T for every block, float32, (block_num, block_size, block_size)."""
        blocks = self.oft_blocks.float()
        q = blocks - blocks.transpose(1, 2)
        if self.constraint > 0:
            norm = q.norm() + 1e-8
            q = torch.where(norm > self.constraint, q * (self.constraint / norm), q)
        eye = torch.eye(self.block_size, device=q.device, dtype=q.dtype).expand_as(q)
        rotation_t = torch.linalg.solve(eye + q, eye - q)
        if self.rank_dropout and training:
            keep = (torch.rand(self.block_num, device=q.device) >= self.rank_dropout).view(-1, 1, 1)
            rotation_t = torch.where(keep, rotation_t, eye)
        return rotation_t

    def adapt(self, module, x, output, training):
        rotation_t = self.rotation_t(training)
        bias = self.bias_of(module, output)
        y = output if bias is None else output - bias
        if self.is_conv:
            y = y.movedim(1, -1)
        blocks = y.float().unflatten(-1, (self.block_num, self.block_size))
        change = torch.einsum("kmn,...kn->...km", rotation_t, blocks) - blocks
        change = change.flatten(-2)
        if self.is_conv:
            change = change.movedim(-1, 1)
        if self.dropout and training:
            change = F.dropout(change, self.dropout)
        return output + change.to(output.dtype)

    def merged_weight(self) -> torch.Tensor:
        with torch.no_grad():
            base = self.base_weight()
            rows = base.view(self.block_num, self.block_size, -1)
            return torch.einsum("kmn,knc->kmc", self.rotation_t(), rows).reshape(base.shape)

    def delta_weight(self, training: bool = False) -> torch.Tensor:
        return self.merged_weight() - self.base_weight()
