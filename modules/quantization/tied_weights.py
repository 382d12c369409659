"""Which weights a model ties (one tensor under two names), as transformers itself decides."""

from __future__ import annotations

from torch import nn


def tied_weight_keys(model: nn.Module) -> dict[str, str]:
    """Alias -> source parameter name of each pair `model` ties. transformers 5 sets
    `all_tied_weights_keys` on a built model from its class's `_tied_weights_keys` and its config:
    SmolLM3's `lm_head.weight` -> `model.embed_tokens.weight` only where `tie_word_embeddings` is
    true, T5's `encoder.embed_tokens.weight` -> `shared.weight` always. The class attribute alone
    (the fallback, for a model without the instance's) lists a head's tie even where the config
    unties it."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if keys is None:
        keys = getattr(model, "_tied_weights_keys", None)
    return dict(keys) if isinstance(keys, dict) else {}
