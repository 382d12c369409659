"""Attention as the GPU runs it, for the fake pass: the trainer pins scaled_dot_product_attention to
flash, then memory-efficient attention (modules/trainer/sdpa.py), which never hold the L x L score
matrix; on the meta device torch would pick the math fallback, which does, and a plan would count
gigabytes no GPU holds. So each call is routed to the memory-efficient kernel's own op (its meta
kernel and autograd formula are torch's), which keeps the output and a float32 log-sum-exp per
query for the backward, as flash does."""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

_lock = threading.Lock()


@contextlib.contextmanager
def efficient_attention():
    """F.scaled_dot_product_attention routed as above while the block runs. A patch of the function
    itself, not a TorchFunctionMode: checkpointing recomputes blocks in the backward pass, where
    autograd does not carry a Python mode along, and a recomputation that attends otherwise saves
    other tensors (torch refuses that)."""
    with _lock:
        original = F.scaled_dot_product_attention

        def routed(*args, **kwargs):
            out = _efficient(*args, **kwargs)
            return original(*args, **kwargs) if out is None else out

        F.scaled_dot_product_attention = routed
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original


def _efficient(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None  # what the kernel cannot take runs as it would (the math fallback)
    if enable_gqa and key.shape[1] != query.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attn_mask, float("-inf"))
        while attn_mask.dim() < 4:
            attn_mask = attn_mask.unsqueeze(0)
        bias = attn_mask.to(query.dtype).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, query.requires_grad or key.requires_grad or value.requires_grad,
        dropout_p, is_causal, scale=scale)
    return out[0]
