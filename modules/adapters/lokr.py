"""LoKr (LyCORIS): dW = scale * kron(w1, w2), the Kronecker product of a small and a large factor;
with `weight_decompose`, DoRA's magnitude/direction split on top (weight-decomposed LoKr).

The layer's out and in dimensions are each split into two factors by `factorize` (LyCORIS's
rule): out = out_l * out_k, in = in_m * in_n, with w1 (out_l, in_m) the small factor and w2
(out_k, in_n[, kh, kw]) the large one. As in LyCORIS's LokrModule, w2 is stored as a low-rank
product w2_a @ w2_b unless the rank is at least half its larger side (or `full_matrix`); w1 is
full unless `decompose_both`, the rank is under half its larger side and not `full_matrix`.
scale = alpha / rank when a factor is low-rank; 1 when both are full (LyCORIS stores alpha = rank
then, and ComfyUI and diffusers ignore it). w2 (or w2_b) starts at zero: a fresh adapter is exact.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from modules.adapters.base import AdapterModule
from modules.adapters.weight_decompose import Axis, WeightDecomposed
from modules.config.adapters.lokr import LoKrConfig


def factorize(dimension: int, factor: int = -1) -> tuple[int, int]:
    """(m, n) with m * n = dimension and m <= n: LyCORIS's `factorization` (the format's owner;
    its loader re-derives every layer's split by this rule and refuses other shapes). A factor
    that divides the dimension gives (factor, dimension / factor), smaller first; otherwise m
    grows through the divisors, each at most `factor` (any, when -1), while m + n does not grow,
    so -1 gives the most nearly square split. (peft keeps a dividing factor first unsorted, so
    where factor^2 > dimension diffusers may not reproduce the split: formats/diffusers.py.)"""
    if factor > 0 and dimension % factor == 0:
        return tuple(sorted((factor, dimension // factor)))
    limit = dimension if factor <= 0 else factor
    m, n = 1, dimension
    while m < n:
        candidate = m + 1
        while dimension % candidate:
            candidate += 1
        if candidate + dimension // candidate > m + n or candidate > limit:
            break
        m, n = candidate, dimension // candidate
    return (m, n) if m <= n else (n, m)




def _lokr_facts(shapes: dict[str, tuple[int, ...]]):
    """(out_l, out_k, in_m, in_n, w1 full, w2 full) of one layer's LoKr tensors; where w2 is
    low-rank, in_n is w2_b's column count, a conv's kernel riding on it (`_builds` tries kernels)."""
    w1 = shapes.get("lokr_w1")
    w1_a, w1_b = shapes.get("lokr_w1_a"), shapes.get("lokr_w1_b")
    w2, w2_a = shapes.get("lokr_w2"), shapes.get("lokr_w2_a")
    if (w1 is None and (w1_a is None or w1_b is None)) or (w2 is None and w2_a is None):
        return None
    out_l, in_m = (w1[0], w1[1]) if w1 is not None else (w1_a[0], w1_b[1])
    out_k = w2[0] if w2 is not None else w2_a[0]
    in_n = (w2[1] if len(w2) >= 2 else None) if w2 is not None else shapes.get("lokr_w2_b", (0, None))[1]
    return out_l, out_k, in_m, in_n, w1 is not None, w2 is not None


_KERNELS = (1, 9, 4, 16, 25, 49)  # a conv's k*k on w2_b's columns (1: a linear layer)


def _builds(fact, rank: int, factor: int, decompose_both: bool, full_matrix: bool) -> bool:
    """Whether LoKrModule with these options makes this layer's factor shapes."""
    out_l, out_k, in_m, columns, w1_full, w2_full = fact
    if factorize(out_l * out_k, factor) != (out_l, out_k):
        return False
    if w1_full != (not (decompose_both and rank < max(out_l, in_m) / 2 and not full_matrix)):
        return False
    kernels = (1,) if w2_full else [k for k in _KERNELS if columns and columns % k == 0]
    for kernel in kernels:
        in_n = columns // kernel if columns else None
        if in_n is not None and factorize(in_m * in_n, factor) != (in_m, in_n):
            continue
        if w2_full == (full_matrix or in_n is None or not rank < max(out_k, in_n) / 2):
            return True
    return False


class LoKrModule(WeightDecomposed, AdapterModule):
    algorithm = "lokr"
    config_class = LoKrConfig
    key_names = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
    unsupported_keys = {"lokr_t2": "LoKr's Tucker (CP) core"}
    peft_scaled = ("lokr_w1", "lokr_w1_a")  # where diffusers' own LoKr converter folds it too

    @classmethod
    def from_config(cls, config, part, name, module, device, dtype, output_format="kohya"):
        rank, alpha = config.size_for(part)
        return cls(name, module, rank, alpha, factor=config.factor, decompose_both=config.decompose_both,
                   full_matrix=config.full_matrix, weight_decompose=config.dora,
                   dora_axis=config.resolved_dora_axis(output_format) or "output",
                   **cls.common_options(config, device, dtype))

    @classmethod
    def network_args(cls, config, output_format):
        return {"factor": config.factor, "decompose_both": config.decompose_both, "full_matrix": config.full_matrix}

    @classmethod
    def options_from_file(cls, config, layers, rank):
        """factor, decompose_both and full_matrix that rebuild every LoKr layer's factor shapes:
        the candidate that changes fewest options wins, explicit settings kept where any fits."""
        facts = {stem: fact for stem, shapes in layers.items() if (fact := _lokr_facts(shapes))}
        if not facts:
            return {}
        rank = rank or config.rank
        sides = sorted({side for fact in facts.values() for side in fact[:4] if side})
        explicit = config.model_fields_set
        current = {"factor": config.factor, "decompose_both": config.decompose_both, "full_matrix": config.full_matrix}
        best = None
        for factor in dict.fromkeys([config.factor, -1, *sides]):
            for both in (config.decompose_both, not config.decompose_both):
                for full in (config.full_matrix, not config.full_matrix):
                    options = {"factor": factor, "decompose_both": both, "full_matrix": full}
                    if not all(_builds(fact, rank, **options) for fact in facts.values()):
                        continue
                    changed = [k for k in options if options[k] != current[k]]
                    cost = (sum(k in explicit for k in changed), len(changed))
                    if best is None or cost < best[0]:
                        best = (cost, options, changed)
        if best is None:
            return {}  # no option rebuilds it: the loader names the shapes that differ
        example = next(iter(facts))
        return {k: (best[1][k], f"{example}.lokr_w1" if "lokr_w1" in layers[example] else example)
                for k in best[2]}

    def default_alpha(self, local):
        for key in ("lokr_w2_b", "lokr_w1_b"):
            if key in local:
                return float(local[key].shape[0])
        return float(self.alpha)  # both factors full: alpha is not used

    def peft_unsupported(self):
        return "peft's LoKr has no weight decomposition; use 'kohya' or 'comfy'" if self.dora_axis else None

    @classmethod
    def peft_set_problem(cls, adapters):
        """diffusers' loader keeps no factor in the file: it tries each w1 height as peft's
        `decompose_factor` (then -1) until peft's factorization reproduces every layer's split.
        peft keeps a dividing factor first where LyCORIS (this trainer) sorts it, so a factor whose
        square exceeds a width may find none."""
        from peft.tuners.lokr.layer import factorization

        splits = [a.splits for a in adapters]
        for candidate in sorted({out[0] for out, _ in splits}) + [-1]:
            if all(factorization(o[0] * o[1], candidate) == o and factorization(i[0] * i[1], candidate) == i
                   for o, i in splits):
                return None
        return ("diffusers re-derives LoKr's factor splits with peft's rule, which differs from LyCORIS's where "
                "adapter.factor squared exceeds a layer's width; use 'kohya' or 'comfy', or a smaller factor")

    def __init__(self, name: str, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 rank_dropout: float = 0.0, module_dropout: float = 0.0, factor: int = -1,
                 decompose_both: bool = False, full_matrix: bool = False, weight_decompose: bool = False,
                 dora_axis: Axis = "output"):
        super().__init__(name, base, dropout=dropout, rank_dropout=rank_dropout, module_dropout=module_dropout)
        out_l, out_k = factorize(self.out_dim, factor)
        in_m, in_n = factorize(self.in_dim, factor)
        kernel = math.prod(self.kernel_size)
        self.splits = ((out_l, out_k), (in_m, in_n))
        self.w2_shape = (out_k, in_n, *self.kernel_size)
        self.rank = rank
        self.use_w1 = not (decompose_both and rank < max(out_l, in_m) / 2 and not full_matrix)
        self.use_w2 = full_matrix or not rank < max(out_k, in_n) / 2
        factory = {"device": device, "dtype": dtype}
        if self.use_w1:
            self.lokr_w1 = nn.Parameter(torch.empty(out_l, in_m, **factory))
            nn.init.kaiming_uniform_(self.lokr_w1, a=math.sqrt(5))
        else:
            self.lokr_w1_a = nn.Parameter(torch.empty(out_l, rank, **factory))
            self.lokr_w1_b = nn.Parameter(torch.empty(rank, in_m, **factory))
            nn.init.kaiming_uniform_(self.lokr_w1_a, a=math.sqrt(5))
            nn.init.kaiming_uniform_(self.lokr_w1_b, a=math.sqrt(5))
        if self.use_w2:
            self.lokr_w2 = nn.Parameter(torch.zeros(*self.w2_shape, **factory))
        else:
            self.lokr_w2_a = nn.Parameter(torch.empty(out_k, rank, **factory))
            self.lokr_w2_b = nn.Parameter(torch.zeros(rank, in_n * kernel, **factory))
            nn.init.kaiming_uniform_(self.lokr_w2_a, a=math.sqrt(5))
        if self.use_w1 and self.use_w2:
            alpha = float(rank)  # no low-rank factor, no scaling: stored as LyCORIS stores it
        self.register_buffer("alpha", torch.tensor(float(alpha), device=device), persistent=True)
        self._refresh_scale(float(alpha))  # from the number: the buffer may be on meta (a planned model)
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh_scale())
        if weight_decompose:
            self.setup_decomposition(dora_axis, device, dtype)

    def _refresh_scale(self, alpha: float | None = None) -> None:
        alpha = float(self.alpha) if alpha is None else alpha
        self.scale = 1.0 if self.use_w1 and self.use_w2 else alpha / self.rank

    def delta_weight(self, training: bool = False) -> torch.Tensor:
        w1 = self.lokr_w1 if self.use_w1 else self.lokr_w1_a @ self.lokr_w1_b
        # a conv's kernel rides on w2's columns: kron of the flattened factors is the 4-D kron
        w2 = self.lokr_w2.flatten(1) if self.use_w2 else self.lokr_w2_a @ self.lokr_w2_b
        weight = torch.kron(w1, w2) * self.scale
        return self.row_dropout(weight, training).view(self.weight_shape)

    def adapt(self, module, x, output, training):
        if self.dora_axis is None:
            return super().adapt(module, x, output, training)
        delta_out = self.delta(x, training) if self.dora_axis == "output" else None
        return self.decomposed_output(module, x, output, delta_out, training)

    def merged_weight(self) -> torch.Tensor:
        return self.decomposed_weight() if self.dora_axis else super().merged_weight()
