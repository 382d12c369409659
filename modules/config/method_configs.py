"""What a run trains, `config.method`: the declared union of training methods
(modules/config/tagged.py). Each method's config, implementation and traits are declared in its own
file, modules/config/methods/<method>.py; the methods themselves are in modules/methods/."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modules.config.strict import StrictModel
from modules.config.tagged import TaggedUnion

DEFAULT_METHOD_TYPE = "adapter"  # what a config without method.type trains


class MethodConfigBase(StrictModel):
    """A training method's config: a subclass narrows `type` to a Literal of its name and adds its
    own options; `check_config` holds its rules about the rest of the config."""

    type: str

    def check_config(self, config: Any) -> None:
        """Raise a located error where the rest of `config` does not fit this method."""

    def steps_in_backward(self) -> bool:
        """Whether the optimizer steps each weight inside the backward pass (a fused backward), before
        several processes' gradients could be averaged."""
        return False


@dataclass(frozen=True)
class MethodTraits:
    """What a training method declares beside its config (register(..., trait=value))."""

    # it trains the model parts' own weights (sized with their optimizer state, gathered to save)
    trains_model_weights: bool = False
    # it trains the embeddings itself (then they are no companion method beside it)
    trains_embeddings: bool = False
    # it trains `config.adapter` (the adapter settings are read, checked and compared on resume)
    uses_adapter: bool = False


METHODS = TaggedUnion("method", base=MethodConfigBase, default=DEFAULT_METHOD_TYPE, traits=MethodTraits,
                      package="modules.config.methods")


def register_method_config(config_class: type[MethodConfigBase], implementation: Any, **traits: Any):
    """Declare a training method: its config, its TrainingMethod class ("module:attr" or the class)."""
    return METHODS.register(config_class, implementation, **traits)
