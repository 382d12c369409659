"""OFT (LyCORIS "diag-oft", what ComfyUI and Forge load): a block-diagonal orthogonal rotation of
the layer's output channels, W' = blockdiag(R_k^T) W, the bias left as it is.

Each block R_k is the Cayley transform of a skew-symmetric Q_k = B_k - B_k^T of the stored
`oft_blocks` B (block_num, block_size, block_size): R = (I + Q)(I - Q)^-1, orthogonal for any B,
and the identity at B = 0, where a fresh adapter starts. R^T is solved for, not inverted:
(I + Q) R^T = (I - Q).

The layout is LyCORIS's DiagOFTModule (its loader re-derives it and refuses any other):
(block_size, block_num) = factorization(out_channels, block_size), the smaller factor being
the block size (320 channels with 32: 32 blocks of 10). `alpha` is LyCORIS's constraint: ||Q||
(all blocks) is clipped to alpha * out_channels; 0: none. A1111 reads the same constraint but
takes 0 as "clip to 0" (no rotation at all), and ComfyUI clips to alpha itself, so a file never
carries 0: formats/files.py writes a bound no reader reaches (`file_alpha`).

peft's OFT rotates the layer's input features instead (y = W R x); the block math is the same,
the side differs, so the two file layouts do not convert into each other.
Rank dropout keeps a block unrotated with that probability; dropout acts on the change of the
output; module dropout skips the adapter.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from modules.adapters.base import AdapterModule, InertAdapter
from modules.adapters.lokr import factorize
from modules.config.adapters.oft import OFTConfig

# header of a file whose alphas are bounds no reader reaches (`file_alpha`): this trainer reads
# them back as "no constraint"
_UNCONSTRAINED = "difftrainer.oft_unconstrained"


def block_layout(dimension: int, wanted: int) -> tuple[int, int]:
    """(block_size, block_num) as LyCORIS lays out `dimension` channels for `wanted`."""
    return factorize(dimension, wanted)




class OFTModule(AdapterModule):
    algorithm = "oft"
    config_class = OFTConfig
    key_names = ("oft_blocks",)
    unsupported_keys = {"rescale": "rescaled OFT", "oft_diag": "A1111's old OFT layout"}
    lycoris_algo = "diag-oft"

    @classmethod
    def from_config(cls, config, part, name, module, device, dtype, output_format="kohya"):
        return cls(name, module, config.block_size, constraint=config.constraint,
                   **cls.common_options(config, device, dtype))

    @classmethod
    def network_args(cls, config, output_format):
        return {"constraint": config.constraint}

    @classmethod
    def network_dim_alpha(cls, config):
        return config.block_size, config.constraint

    @classmethod
    def options_from_file(cls, config, layers, rank):
        """The block_size that lays out every layer's blocks as the file has them (the constraint
        is each layer's alpha, read with the tensors)."""
        found = {stem: shapes["oft_blocks"] for stem, shapes in layers.items()
                 if len(shapes.get("oft_blocks", ())) == 3}
        if not found:
            return {}
        candidates = dict.fromkeys([config.block_size, *sorted({s for shape in found.values() for s in shape[:2]})])
        for size in candidates:
            if size >= 2 and all(block_layout(n * b, size) == (b, n) for n, b, _ in found.values()):
                stem = next(iter(found))
                return {} if size == config.block_size else {"block_size": (size, f"{stem}.oft_blocks")}
        return {}

    def default_alpha(self, local):
        return 0.0  # no constraint

    def file_tensors(self):
        tensors = super().file_tensors()
        tensors["alpha"] = self.file_alpha()  # never 0: A1111 reads that as "no rotation"
        return tensors

    @classmethod
    def file_header(cls, adapters):
        return {_UNCONSTRAINED: "1"} if any(float(a.alpha) == 0 for a in adapters) else {}

    def from_file(self, local, metadata):
        if metadata.get(_UNCONSTRAINED) == "1":
            local = {**local, "alpha": torch.tensor(0.0)}
        return local

    def peft_unsupported(self):
        return ("peft's OFT rotates a layer's input features and LyCORIS/ComfyUI's OFT (this one) its "
                "output channels, so no peft layout holds it; use 'kohya' or 'comfy'")

    def __init__(self, name: str, base: nn.Module, block_size: int, dropout: float = 0.0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 rank_dropout: float = 0.0, module_dropout: float = 0.0, constraint: float = 0.0):
        super().__init__(name, base, dropout=dropout, rank_dropout=rank_dropout, module_dropout=module_dropout)
        size, number = block_layout(self.out_dim, block_size)
        if size < 2:  # 1x1 blocks rotate nothing (Q = B - B^T = 0): LyCORIS would make a no-op there
            raise InertAdapter(f"LyCORIS's OFT layout for adapter.block_size {block_size} splits their "
                               "output channels into 1-wide blocks, which cannot rotate")
        self.block_size, self.block_num = size, number
        self.oft_blocks = nn.Parameter(torch.zeros(self.block_num, size, size, device=device, dtype=dtype))
        self.register_buffer("alpha", torch.tensor(float(constraint), device=device), persistent=True)
        # from the argument, not the buffer: the planner builds adapters of fake tensors, which have no value
        self._refresh_constraint(float(constraint))
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh_constraint())

    def _refresh_constraint(self, alpha: float | None = None) -> None:
        # a Python float, read once, so the forward never syncs on it; LyCORIS scales it by the width
        self.constraint = (float(self.alpha) if alpha is None else alpha) * self.out_dim

    def file_alpha(self) -> torch.Tensor:
        """The alpha a file gets: the constraint, or without one a bound above ||Q|| that neither
        LyCORIS/A1111 (alpha * out_channels) nor ComfyUI (alpha) reaches, since A1111 reads 0 as
        "no rotation"."""
        if float(self.alpha) > 0:
            return self.alpha.detach()
        with torch.no_grad():
            blocks = self.oft_blocks.float()
            norm = float((blocks - blocks.transpose(1, 2)).norm())
        return torch.tensor(max(norm * 1.01, 1e-3), device=self.alpha.device)

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
