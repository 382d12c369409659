"""transformers treats the planner's meta tensors as it treats fake ones, for the pass only.

transformers' attention-mask helpers (masking_utils.py: `_ignore_causal_mask_sdpa`,
`_ignore_bidirectional_mask_sdpa`, ...) skip building a 4D mask where they can read that no token is
padded (`padding_mask.all()`), unless `is_tracing(tensor)` says the values cannot be read: then they
build the full mask (the larger memory, and what the fake pass counted). `is_tracing` asks
`is_fake_tensor`, which nothing else in transformers calls, so answering it for meta tensors too
makes every such check take the fake pass's branch on the meta pass: the same ops, the same bytes
(tests/test_plan_meta_pass.py). Chosen over answering the value reads themselves in the meta
dispatch (a bool read as "not all"): that would have to guess, read by read, which answer the
traced branch gives (`.all()` and `.any()` want opposite ones), where this reuses transformers' own
answer for values it cannot read.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def meta_tensors_traced():
    from transformers.utils import import_utils

    original = import_utils.is_fake_tensor

    def is_fake_or_meta(tensor) -> bool:
        return (isinstance(tensor, torch.Tensor) and tensor.is_meta) or original(tensor)

    import_utils.is_fake_tensor = is_fake_or_meta
    try:
        yield
    finally:
        import_utils.is_fake_tensor = original
