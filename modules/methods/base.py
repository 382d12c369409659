"""TrainingMethod: what a run trains (an adapter, the weights themselves, embeddings), behind one
small interface, so the trainer's loop names no method.

A method gives the trainer its parameter groups, the weights a backup holds, and its saved files;
the trainer owns everything else (the model, the data, the optimizer, EMA, the step). A run has one
main method (`config.method`) and may add companions (e.g. embeddings trained alongside a LoRA);
`build_methods` makes them all. A new method is a TrainingMethod subclass and one file in
modules/config/methods/ declaring its config, that class and its traits (docs/members.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from modules.config.method_configs import METHODS

# the trainer that owns a method (modules/trainer/generic_trainer.py); not imported, even for typing:
# methods sit below trainer (tests/test_import_layers.py)
GenericTrainer = object

if TYPE_CHECKING:
    from modules.config.train_config import TrainConfig


class TrainingMethod(ABC):
    # the `type` of its config in config.method ("" for companions that are not a main method)
    name: ClassVar[str]
    # its keys in a backup's weights file start with this; "" for the adapter, whose keys were
    # unprefixed before methods existed (backups of those runs still resume)
    state_prefix: ClassVar[str] = ""
    # whether its saved files hold the model's own weights (then a sharded part is gathered to save)
    saves_model_weights: ClassVar[bool] = False

    def __init__(self, trainer: GenericTrainer):
        self.trainer = trainer
        self.config = trainer.config
        self.family = trainer.family
        self.device = trainer.device

    @abstractmethod
    def trained_parts(self) -> list[str]:
        """The model parts whose modules this method changes (put in train mode, given their own lr).
        Called right after the family is made, before the model loads."""

    @abstractmethod
    def setup(self) -> None:
        """Make the trained weights trainable (after the model is on the train device)."""

    @abstractmethod
    def parameter_groups(self, config: TrainConfig) -> list[dict]:
        """Optimizer groups {"params", "lr", "name"} at `config`'s learning rates (the trainer may scale
        lr; `config` can be an older run's, to rebuild its groups on resume)."""

    @abstractmethod
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every trained parameter, named (the first-step guard, clipping and EMA use them)."""

    def guarded_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters the first-step guard holds to having learned (modules/trainer/guards.py):
        all of them, unless a method knows some rightly got no gradient in that step."""
        return self.named_parameters()

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights a backup holds (keys without state_prefix)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, torch.Tensor], source: str) -> None:
        """Put a backup's weights back; `source` names the file in errors."""

    @abstractmethod
    def save(self, path: Path, dtype: torch.dtype, metadata: dict[str, str]) -> list[Path]:
        """Write the trained result for people to use at `path` (the output path, or a periodic save's);
        the files written, the main one first. Called with the evaluation weights (EMA) swapped in."""

    def consumers(self, file: Path) -> dict[str, dict] | None:
        """Per tool that loads it, how many of a file this method saved it applies (and which it
        drops): modules/saving/consumers/check.py. None: no tool's map is kept for such a file."""
        return None

    def first_backup_warnings(self) -> list[str]:
        """Warnings due once the first backup is written (what the saved file will lose in its tool)."""
        return []

    def text_cache_allowed(self) -> bool:
        """Whether cached text conditioning stays valid while this method trains."""
        return not any(part in self.family.text_parts for part in self.trained_parts())

    def expand_captions(self, captions: list[str]) -> list[str]:
        """The captions as this method's tokens need them before tokenizing (a multi-vector embedding's
        placeholder written out as its tokens); unchanged by default."""
        return captions

    def parameters_replaced(self) -> None:
        """Called after model parts were sharded (modules/trainer/sharding.py), which puts new
        (DTensor) parameters in the modules: a method holding the model's own parameters looks them
        up again."""

    def steps_in_backward(self) -> bool:
        """True where the optimizer steps each parameter inside the backward pass (a fused backward):
        the trainer then neither clips nor steps after it."""
        return False

    def optimizer_ready(self, optimizer: torch.optim.Optimizer) -> None:
        """Called once the trainer's optimizer holds this method's groups (a fused backward steps it)."""

    def gradients_seen(self) -> dict[str, bool] | None:
        """For the first-step guard where gradients are freed in the backward pass (a fused backward):
        name -> whether the parameter's first gradient was non-zero; None: read `.grad` as usual."""
        return None

    def recorded_moves(self) -> dict[str, bool] | None:
        """For the first-step guard where the stored value cannot show a step (a tiny update of a
        bfloat16 weight rounded back to its old value): name -> whether the optimizer changed it, in
        the first step, then in the steps since `record_moves`."""
        return None

    def record_moves(self, names: set[str]) -> None:
        """Record, from the next step, `recorded_moves` of these parameters (those the guard watches)."""

    def stepped_parameters(self, optimizer: torch.optim.Optimizer) -> set[int]:
        """The ids of this method's parameters that an optimizer step updates (the first-step guard's
        "in the optimizer"): those its groups hold now."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return {id(p) for _, p in self.named_parameters() if id(p) in held}

    @classmethod
    def planned_size(cls, config: TrainConfig, family):
        """What a backup and a saved file of this method hold, before the model loads (an
        modules.adapters.adapter_size.AdapterSize), for the preflight's disk estimate; None: not sized."""
        return None

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]


def method_class(name: str) -> type[TrainingMethod]:
    """The TrainingMethod that `method.type: name` trains with (declared in modules/config/methods/)."""
    return METHODS.member(name).load()


def build_methods(trainer: GenericTrainer) -> list[TrainingMethod]:
    """The run's main method (config.method), then its companions: the embeddings, whenever the
    config has some and the main method does not train them itself (they train beside it, or are
    used frozen)."""
    main = trainer.config.method.type
    methods = [method_class(main)(trainer)]
    if trainer.config.embeddings and not METHODS.traits(main).trains_embeddings:
        companion = next(m for m in METHODS.members().values() if m.traits.trains_embeddings)
        methods.append(companion.load()(trainer))
    return methods


def split_state(methods: list[TrainingMethod], state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """A backup's weights, one dict per method: each prefixed method takes its keys (prefix removed),
    the unprefixed method the rest."""
    taken: set[str] = set()
    parts: list[dict[str, torch.Tensor] | None] = []
    for method in methods:
        if method.state_prefix:
            own = {k[len(method.state_prefix):]: v for k, v in state.items() if k.startswith(method.state_prefix)}
            taken.update(method.state_prefix + k for k in own)
            parts.append(own)
        else:
            parts.append(None)
    rest = {k: v for k, v in state.items() if k not in taken}
    return [rest if part is None else part for part in parts]


def joined_state(methods: list[TrainingMethod]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for method in methods:
        state.update({method.state_prefix + k: v for k, v in method.state_dict().items()})
    return state
