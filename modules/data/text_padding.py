"""Text conditioning cached without its padding.

A family that pads each caption's encoding to a fixed window but masks the padding out of its
denoiser (so the padded positions change nothing: its own tests show it) names those tensors in
ModelFamily.masked_text_padding, each with its mask and its token axis. The text cache then holds
only the real tokens of each caption (the mask's ones, in order) beside the whole mask, and where a
batch is assembled each tensor is put back in its window, zeros at the padded positions: the batch
has the padded encoding's shapes and, the padding being masked, its predictions. For FIBO-2 that is
a caption's few hundred tokens instead of a 2048-token window (docs/data.md has the sizes).

The cache keys of such a family's captions name the trimming (stored_text_identity), so entries
written whole before it are never read as trimmed ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from modules.data.cache import CacheEntryGone

if TYPE_CHECKING:
    from modules.data.cache_layout import Layout
    from modules.model.base import ModelFamily

# conditioning tensor name -> (the name of its mask, its token axis in one caption's tensor)
PaddingSpec = dict[str, tuple[str, int]]


def stored_text_identity(family: ModelFamily) -> str:
    """What the text cache keys hash for the family's encoders and for how their output is stored."""
    identity = family.fingerprint(*family.text_parts)
    spec = family.masked_text_padding
    if not spec:
        return identity  # stored whole, as always: the keys are unchanged
    return f"{identity}|real-tokens-only:{sorted((name, *where) for name, where in spec.items())}"


def _kept(mask: torch.Tensor) -> torch.Tensor:
    return mask.reshape(-1).bool().nonzero().squeeze(1)


def real_tokens(row: dict[str, torch.Tensor], spec: PaddingSpec) -> dict[str, torch.Tensor]:
    """One caption's conditioning as the cache stores it: each named tensor cut to its real tokens."""
    out = dict(row)
    for name, (mask, axis) in spec.items():
        out[name] = row[name].index_select(axis, _kept(row[mask].to(row[name].device))).contiguous()
    return out


def padded(row: dict[str, torch.Tensor], spec: PaddingSpec) -> dict[str, torch.Tensor]:
    """A stored caption's conditioning back in its window: zeros where the mask is 0."""
    out = dict(row)
    for name, (mask, axis) in spec.items():
        tensor, kept = row[name], _kept(row[mask])
        if tensor.shape[axis] != kept.numel():
            raise CacheEntryGone(f"a text cache entry holds {tensor.shape[axis]} tokens of {name!r} where its "
                                 f"mask has {kept.numel()}; was the cache folder changed during the run? "
                                 "Start the run again to rebuild it")
        shape = list(tensor.shape)
        shape[axis] = row[mask].numel()
        out[name] = tensor.new_zeros(shape).index_copy_(axis, kept, tensor)
    return out


def real_token_layout(whole: Layout, spec: PaddingSpec, real: dict[str, int]) -> Layout:
    """The stored layout of a caption whose masks have `real` ones (by mask name), from the layout of
    a whole (padded) encoding."""
    layout = dict(whole)
    for name, (mask, axis) in spec.items():
        dtype, shape = whole[name]
        layout[name] = (dtype, shape[:axis] + (real[mask],) + shape[axis + 1:])
    return layout
