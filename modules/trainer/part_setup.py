"""Each model part made ready for training, in the lifecycle's order (docs/architecture.md, lifecycle 3-4):
gradient checkpointing and torch.compile of its blocks, then its place on the train device (with a
LayerOffloadConductor where part of it is parked on the temp device)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from modules.config.errors import ConfigError
from modules.offload.checkpointing import checkpoint_blocks_
from modules.offload.conductor import LayerOffloadConductor
from modules.offload.host_tables import HostTable, host_tables, place_around_tables
from modules.quantization.compile_gate import compile_blocker
from modules.trainer.cuda_math import configure_cuda_math
from modules.trainer.offload_fraction import offload_fraction, placement_order
from modules.trainer.regional_compile import compile_regions_

if TYPE_CHECKING:
    from modules.trainer.generic_trainer import GenericTrainer


def setup_optimizations(trainer: GenericTrainer) -> None:
    """Per part: weight modes are applied at load (quantized layers replace Linear there);
    gradient checkpointing (with activation offloading); torch.compile of the repeated blocks
    where it can work."""
    parts = trainer.config.model.parts
    temp_device = torch.device(trainer.config.temp_device)
    for name, part in parts.items():
        if part.gradient_checkpointing:
            blocks = trainer.family.checkpoint_blocks(name)
            if not blocks:
                raise ConfigError([f"model.parts.{name}.gradient_checkpointing: the {trainer.family.name} family "
                                   f"lists no blocks to checkpoint in {name}"])
            checkpoint_blocks_(blocks, temp_device if part.activation_offloading else None)
    if not trainer.config.compile:
        return
    for part in dict.fromkeys([trainer.family.denoiser_part, *trainer.trained_parts]):
        if parts[part].offload_fraction != 0:
            blocker = "layer offloading moves weights between blocks, which the compiled graph cannot see"
        else:
            blocker = compile_blocker(trainer.family.weight_mode(part), str(trainer.device),
                                      trainer.family.compute_dtype(part))
        if blocker:
            trainer.callbacks.on_warning(f"compile: off for model.parts.{part} ({blocker})")
            continue
        compiled = compile_regions_(trainer.family.parts[part], trainer.family.checkpoint_blocks(part))
        trainer.callbacks.on_status(f"compile: model.parts.{part}: {len(compiled)} block(s) compile on first use")


def setup_train_device(trainer: GenericTrainer) -> dict[str, LayerOffloadConductor]:
    """Move each part to the train device; a part with offload_fraction > 0 gets a
    LayerOffloadConductor first, which keeps its parked blocks on the temp device; a frozen text
    encoder's token table stays on the host (offload/host_tables.py: trainer.host_tables)."""
    configure_cuda_math(trainer.device, trainer.config.tf32)  # before the first matmul on the device
    conductors: dict[str, LayerOffloadConductor] = {}
    trainer.host_tables = {name: HostTable(lookups, trainer.device, f"model.parts.{name}") for name, lookups
                           in host_tables(trainer.config, trainer.family, trainer.trained_parts).items()}
    # a part only sampling runs stays on the temp device (resting_parts.py brings it for samples)
    order = [name for name in placement_order(trainer) if name not in trainer.family.resting_parts()]
    for position, name in enumerate(order):
        module = trainer.family.parts[name]
        fraction = offload_fraction(trainer, name, order[position + 1:])
        on_host = trainer.host_tables[name].module_ids() if name in trainer.host_tables else set()
        if fraction > 0:
            conductor = LayerOffloadConductor(trainer.family.checkpoint_blocks(name), fraction, trainer.device,
                                              torch.device(trainer.config.temp_device), name,
                                              trainer.config.model.parts[name].offload_prefetch)
            conductor.start()
            place_around_tables(module, trainer.device, conductor.owned_modules() | on_host)
            conductors[name] = conductor
            trainer.callbacks.on_status(conductor.describe())
        elif on_host:
            place_around_tables(module, trainer.device, on_host)
        else:
            module.to(trainer.device)
        if on_host and trainer.device.type != "cpu":
            trainer.callbacks.on_status(f"model.parts.{name}: its token table stays on the host (frozen: looked up "
                                        f"there, {trainer.host_tables[name].nbytes / 2**20:.1f} MiB off the train "
                                        f"device)")
    return conductors
