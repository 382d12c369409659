"""The LoKr adapter algorithm's config and traits (its module: modules/adapters/lokr.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from modules.config.adapter_configs import (AdapterConfigBase, DecompositionOptions, LowRankOptions,
                                           register_adapter_config)
from modules.config.limits import MAX_RANK


class LoKrConfig(DecompositionOptions, LowRankOptions, AdapterConfigBase):
    type: Literal["lokr"] = Field("lokr", description="lokr: a Kronecker product of a small and a large factor "
                                  "(with dora: weight-decomposed LoKr).")
    factor: int = Field(-1, ge=-1, le=MAX_RANK,
        description="Split each dimension with this factor; -1: as square as possible.")
    decompose_both: bool = Field(False, description="Make the small factor low-rank too.")
    full_matrix: bool = Field(False, description="Keep the large factor a full matrix whatever the rank.")

    @field_validator("factor")
    @classmethod
    def _valid_factor(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(f"must be -1 (as square as possible) or a positive factor (got {value})")
        return value


register_adapter_config(LoKrConfig, "modules.adapters.lokr:LoKrModule", label="LoKr")
