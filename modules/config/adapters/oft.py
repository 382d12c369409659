"""The OFT adapter algorithm's config and traits (its module: modules/adapters/oft.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modules.config.adapter_configs import AdapterConfigBase, register_adapter_config
from modules.config.limits import MAX_RANK


class OFTConfig(AdapterConfigBase):
    type: Literal["oft"] = Field("oft", description="oft: a block-diagonal orthogonal rotation of the output "
                                 "channels.")
    block_size: int = Field(32, ge=2, le=MAX_RANK,
        description="LyCORIS's block rule: a layer's output channels split into "
                            "two factors as LoKr splits with this factor, the smaller one the block size (320 "
                            "channels with 32: 32 blocks of 10; 1280: 40 blocks of 32).")
    constraint: float = Field(0.0, ge=0, le=1000,
        description="LyCORIS's constraint: the rotation's skew part is clipped "
                              "to this times the layer's output channels; 0: none. Exact in LyCORIS and A1111; "
                              "ComfyUI clips to the value itself (differs once it binds).")


register_adapter_config(OFTConfig, "modules.adapters.oft:OFTModule", label="OFT")
