"""The embedding method: train only textual-inversion embeddings (modules/methods/embedding.py)."""

from __future__ import annotations

from typing import Literal

from modules.config.method_configs import MethodConfigBase, register_method_config


class EmbeddingMethodConfig(MethodConfigBase):
    """Train only the textual-inversion embeddings (`embeddings` with train on); the model's weights
    stay frozen, model.parts.*.train is not read, and the run saves the embedding file(s)."""

    type: Literal["embedding"] = "embedding"


register_method_config(EmbeddingMethodConfig, "modules.methods.embedding:EmbeddingMethod", trains_embeddings=True)
