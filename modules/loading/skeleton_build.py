"""A skeleton part: its architecture on the meta device from its config.json, built without
running any initialisation, for a part whose weights are never read (the planner's parts, the
denoiser while `launch.py cache` encodes).

The build a load streams into (streamed_load.empty_model) keeps its buffers on the CPU, computed,
because a checkpoint does not hold them (SD3's positional table, rotary tables), and runs every
initialiser on the meta parameters. A skeleton needs neither: here the default device is `meta`,
so a constructor's tensors are shapes and dtypes only (SD3.5's 384x384 positional table: ~2 s of
CPU when computed), and the torch.nn.init functions do nothing (diffusers' `no_init_weights`; on a
meta default device transformers skips its own `_init_weights` too), where each would run its meta
kernel, ~3 ms a call in torch._refs, to fill nothing. The names, shapes and dtypes of parameters
and buffers are those of the streamed load's build, and a tensor held as a plain attribute is on
the CPU as there (tests/test_skeleton_build.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from modules.loading.streamed_load import model_from_config
from modules.quantization.tied_weights import tied_weight_keys


def skeleton_model(cls: Any, folder: Path, where: str) -> nn.Module:
    """The architecture of a diffusers or transformers class from its config.json, every tensor on
    meta, no initialiser run, tied weights one tensor; frozen and in eval mode."""
    from diffusers.models.modeling_utils import no_init_weights

    def build(make):
        with torch.device("meta"), no_init_weights():
            return make()

    model = tie_skeleton_weights(model_from_config(cls, folder, where, build))
    _plain_tensors_on_the_cpu(model)
    return model.requires_grad_(False).eval()


def _plain_tensors_on_the_cpu(model: nn.Module) -> None:
    """A tensor a module holds as a plain attribute (neither parameter nor buffer: Qwen-Image's
    rotary tables, `pos_freqs`) stays where it was built when the model moves (`Module.to`), on
    the CPU, and the forward that reads it copies it to the device each step, which the planner's
    pass counts as it does in training: such tensors are made on the CPU again, as the load's build
    has them (zeros: a plan reads no values)."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.is_meta:
                setattr(module, name, torch.zeros(value.shape, dtype=value.dtype, device="cpu"))


def tie_skeleton_weights(model: nn.Module) -> nn.Module:
    """An empty model's tied weights made one tensor, as a load of a released file (which holds
    one name of each tied pair: streamed_load._tie_weights) leaves them; an empty build may give
    each name a tensor of its own, so a skeleton would hold T5's `shared` embedding twice."""
    tied = tied_weight_keys(model)
    if tied:
        names = dict(model.named_parameters(remove_duplicate=False))
        for alias, source in tied.items():
            if alias in names and source in names:
                module_name, _, attr = alias.rpartition(".")
                setattr(model.get_submodule(module_name), attr, names[source])
    return model
