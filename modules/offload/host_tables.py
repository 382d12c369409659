"""A frozen text encoder's token table kept on the host: its lookup runs on the CPU and only the
rows it looks up (batch x tokens x width) go to the train device.

The table is the biggest single tensor of most text encoders (UMT5-XXL's 256384 x 4096 bfloat16
is 1.96 GiB, Qwen's and Gemma's alike) and is only ever indexed, so on the train device it costs
its whole size for a few MB of rows per caption. The one rule of which parts do this,
`host_table_parts`, is asked by the trainer (trainer/part_setup.py places the encoder around its
table, trainer/idle_parts.py leaves the table out of the home copies) and by the plan
(plan/run_plan.py counts the table on the host), so the two cannot drift.

The table is not pinned: no copy reads it (the lookup gathers its rows into a fresh tensor, and
that is what crosses the link), so pinning would only lock its bytes in host memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from modules.model.components.embedding_tokens import token_embedding
from modules.offload.layer_tensors import layer_tensors, tensor_bytes
from modules.util.compute_device import ROWS_DEVICE

if TYPE_CHECKING:
    from modules.config.train_config import TrainConfig
    from modules.model.base import ModelFamily

HOST = torch.device("cpu")


def host_table_parts(config: TrainConfig, family: ModelFamily, trained: Iterable[str]) -> tuple[str, ...]:
    """The text parts whose token table stays on the host, in the family's order: the frozen ones
    (not among `trained`, the parts an adapter, a fine-tune or a trained embedding changes). An
    encoder that embeddings loaded from a file (not trained) add tokens to is frozen too: their
    rows are looked up beside the table (AddedTokenRows, on the rows the table sends over). Kept on
    the device: a sharded encoder (its weights are FSDP's), one only sampling runs (it waits on the
    temp device whole). (Training on the CPU the rule holds and changes nothing.)"""
    encoders = [name for name in config.model.parts if name in family.text_parts]
    if not encoders:
        return ()
    kept = {*trained, *config.distributed.shard_parts, *family.resting_parts()}
    return tuple(name for name in encoders if name not in kept)


def table_lookups(encoder: nn.Module, never_run: tuple[str, ...] = ()) -> list[nn.Module]:
    """The modules that stay on the host with `encoder`'s token table: its embedding modules (T5's
    `shared` and the `embed_tokens` its forward runs share one weight) and the modules named in
    `never_run` (the family's: a language model's head, tied to the table or, quantized apart from
    it, not; the device has no use for either). None where the table cannot stay on the host: no
    token embedding, or its weight shared with another layer, which computes with it."""
    try:
        embed = token_embedding(encoder)
    except (AttributeError, NotImplementedError):  # (a module without get_input_embeddings)
        return []
    if not isinstance(embed, nn.Embedding):
        return []
    weight = embed.weight
    idle = [module for name, module in encoder.named_modules() if name in never_run]
    holders = [module for module in encoder.modules()
               if any(p is weight for p in module.parameters(recurse=False))]
    if not all(isinstance(m, nn.Embedding) or any(m is i for i in idle) for m in holders):
        return []
    return holders + [m for m in idle if not any(m is h for h in holders)]


def host_tables(config: TrainConfig, family: ModelFamily, trained: Iterable[str]) -> dict[str, list[nn.Module]]:
    """Part -> the modules that stay on the host with its table (table_lookups), for each part whose
    table stays on the host."""
    tables = {name: table_lookups(family.parts[name], family.never_run.get(name, ()))
              for name in host_table_parts(config, family, trained)}
    return {name: lookups for name, lookups in tables.items() if lookups}


class HostTable:
    """One encoder's token table on the host, its lookups sending their rows to `device`; a module
    that holds it and never runs (table_lookups' `never_run`) stays with it, and is refused if it runs."""

    def __init__(self, lookups: list[nn.Module], device: torch.device, part: str = "the text encoder"):
        self.lookups, self.device, self.part = lookups, torch.device(device), part
        self.handles = []
        for lookup in lookups:
            for tensor in layer_tensors(lookup):  # (a Parameter keeps its identity: tied modules stay tied)
                if tensor.get().device != HOST:
                    tensor.put(tensor.get().to(HOST))
            if not isinstance(lookup, nn.Embedding):
                self.handles.append(lookup.register_forward_pre_hook(self._never_runs))
                continue
            self.handles += [lookup.register_forward_pre_hook(self._ids_home, with_kwargs=True),
                             lookup.register_forward_hook(self._rows_out)]
            setattr(lookup, ROWS_DEVICE, self.device)  # what compute_device answers for the encoder

    def module_ids(self) -> set[int]:
        """ids of the modules that stay on the host (placement and home copies leave them alone)."""
        return {id(lookup) for lookup in self.lookups}

    @property
    def nbytes(self) -> int:
        unique = {id(t.get()): t.get() for lookup in self.lookups for t in layer_tensors(lookup)}
        return sum(tensor_bytes(t) for t in unique.values())

    @staticmethod
    def _ids_home(_module, args, kwargs):
        if args:
            return (args[0].to(HOST), *args[1:]), kwargs
        return args, {**kwargs, "input": kwargs["input"].to(HOST)}

    def _rows_out(self, _module, _args, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(self.device)

    def _never_runs(self, module, _args):
        raise RuntimeError(f"{self.part}: its {type(module).__name__} holding the token table ran, though the "
                           f"family declares it never runs (ModelFamily.never_run), so the table was kept on the "
                           f"host: the family's encoding or pipeline must not run it")


def place_around_tables(module: nn.Module, device: torch.device, skipped: set[int]) -> None:
    """Every layer of `module` onto `device` but those whose ids are in `skipped` (parked blocks'
    layers, a host table's lookups), each moved on its own (Module._apply without recursing)."""
    for child in module.modules():
        if id(child) not in skipped:
            child._apply(lambda t: t.to(device), recurse=False)
