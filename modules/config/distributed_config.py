"""DistributedConfig (`distributed.*`): how many processes train together, and which model parts
are split across them with FSDP2 (modules/trainer/sharding.py). `check_distributed` holds the
rules several processes and a sharded part must meet; TrainConfig calls it with the whole config."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pydantic import Field

from modules.config.errors import located_error
from modules.config.method_configs import METHODS
from modules.config.optimizer_configs import OPTIMIZERS
from modules.config.strict import StrictModel

if TYPE_CHECKING:
    from modules.config.train_config import TrainConfig


class DistributedConfig(StrictModel):
    gpus: int = Field(1, ge=1, le=64, description="Processes on this machine, one per GPU (data parallel "
                      "through torchrun; the CPU with gloo where there is no GPU): each trains its share of "
                      "every step's batches, schedule.batch_size each, and the gradients are averaged. "
                      "1: one process.")
    shard_parts: list[str] = Field(default_factory=list, description="Parts whose weights are split across the "
                                   "GPUs with FSDP2 fully_shard (each rank holds 1/N of them; all-gathered block "
                                   "by block in each forward), for a denoiser too big for one GPU. Only the "
                                   "denoiser, with dense weights and no offloading. Empty: every GPU holds the "
                                   "whole model.")


def _processes(config: TrainConfig) -> int:
    # a run torchrun started directly (several machines: docs/distributed.md) has its world in the environment
    return max(config.distributed.gpus, int(os.environ.get("WORLD_SIZE", "1") or 1))


def check_distributed(config: TrainConfig) -> None:
    """The first problem with running on several processes, raised as a located error."""
    # a fused backward steps each weight inside the backward pass, before any all-reduce could
    # average its gradient with the other processes'
    if config.distributed.gpus > 1 and config.method.steps_in_backward():
        raise located_error("a fused backward steps each weight before the processes' gradients are "
                            "averaged: set method.fused_backward to false to train on several GPUs",
                            "method", "fused_backward")
    check_sharding(config)


def check_sharding(config: TrainConfig) -> None:
    """The first problem with `distributed.shard_parts`, raised as a located error."""
    from modules.config.families import get_family_declaration
    from modules.quantization.weight_modes import get_weight_mode, is_weight_mode

    shard = config.distributed.shard_parts
    if not shard:
        return
    family = get_family_declaration(config.model.family)
    for index, part in enumerate(shard):
        at = ("distributed", "shard_parts", index)
        if part not in config.model.parts:
            raise located_error(f"unknown part {part!r} for family {config.model.family!r} "
                                f"(parts: {', '.join(config.model.parts)})", *at)
        if part != family.denoiser_part:
            # the text encoders and the VAE fill the caches on rank 0 alone while the others wait,
            # so they cannot wait in each forward for the other ranks' shards
            raise located_error(f"only the denoiser ({family.denoiser_part}) can be sharded: {part} encodes the "
                                f"caches on rank 0 alone", *at)
        if shard.index(part) != index:
            raise located_error(f"{part} is listed twice", *at)
    if _processes(config) < 2:
        raise located_error("sharding splits a part across the GPUs: set distributed.gpus to 2 or more "
                            "(with 1 there is nothing to split it over)", "distributed", "shard_parts")
    for part in shard:
        settings = config.model.parts[part]
        if settings.offload_fraction != 0:
            raise located_error(f"{part} is sharded (distributed.shard_parts): each GPU already holds only its "
                                f"1/N of it; set offload_fraction to 0", "model", "parts", part, "offload_fraction")
        mode = settings.weight_dtype
        if mode != "auto" and is_weight_mode(mode) and not get_weight_mode(mode).dense:
            raise located_error(f"{part} is sharded (distributed.shard_parts), which splits dense weights only; "
                                f"{mode} layers keep packed data and scales FSDP cannot split: choose float32, "
                                f"bfloat16 or float16", "model", "parts", part, "weight_dtype")
        if settings.train and METHODS.traits(config.method.type).trains_model_weights:
            _check_sharded_fine_tune(config, part)
    if config.compile:
        raise located_error("torch.compile of sharded parts is not supported: set compile to false, or leave "
                            "distributed.shard_parts empty", "compile")


def _check_sharded_fine_tune(config: TrainConfig, part: str) -> None:
    """A fine-tune of a sharded part trains DTensor weights (sharding.py)."""
    # each optimizer declares whether its step on DTensor weights (each rank's slice) equals one
    # process's step (its `unshardable` trait, with the reason; tests/test_sharded_variants.py)
    why = OPTIMIZERS.traits(config.optimizer.type).unshardable
    if why:
        able = [name for name, member in OPTIMIZERS.members().items() if not member.traits.unshardable]
        raise located_error(f"the fine-tune trains the sharded {part} (distributed.shard_parts), whose weights "
                            f"{config.optimizer.type} cannot step split across GPUs: {why}; choose "
                            f"{', '.join(able)}", "optimizer", "type")
    if config.train_dtype == "float16":
        raise located_error(f"float16's loss scaler cannot check the sharded {part}'s gradients "
                            f"(distributed.shard_parts): use bfloat16 or float32", "train_dtype")
