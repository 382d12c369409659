"""The optimizers, `config.optimizer`: the declared union (modules/config/tagged.py). Each optimizer's
config (its own parameters), builder and traits are declared in its own file,
modules/config/optimizers/<type>.py; the builders are in modules/optim/optimizers.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from modules.config.limits import MAX_EPSILON
from modules.config.strict import StrictModel
from modules.config.tagged import TaggedUnion

Beta = Annotated[float, Field(ge=0, lt=1)]
Betas = tuple[Beta, Beta]
Epsilon = Annotated[float, Field(gt=0, le=MAX_EPSILON)]


DEFAULT_OPTIMIZER_TYPE = "adamw"  # what a config without optimizer.type trains with


class OptimizerConfigBase(StrictModel):
    """An optimizer's config: a subclass narrows `type` to a Literal of its name and adds its own
    parameters (lr among them, each with its own default)."""

    type: str


@dataclass(frozen=True)
class OptimizerTraits:
    """What an optimizer declares beside its config (register(..., trait=value))."""

    # why its step needs every parameter of a group at once (so it cannot step one weight at a
    # time, as a fused backward or stochastic rounding does); None: it can
    needs_whole_step: str | None = None
    # why it cannot step weights split across GPUs (FSDP DTensors; tests/test_sharded_variants.py);
    # None: its step on each rank's slice equals one process's step
    unshardable: str | None = None


OPTIMIZERS = TaggedUnion("optimizer", base=OptimizerConfigBase, default=DEFAULT_OPTIMIZER_TYPE,
                         traits=OptimizerTraits, package="modules.config.optimizers")


def register_optimizer_config(config_class: type[OptimizerConfigBase], implementation: Any, **traits: Any):
    """Declare an optimizer: its config, its builder ("module:attr" or the function (config, groups))."""
    return OPTIMIZERS.register(config_class, implementation, **traits)
