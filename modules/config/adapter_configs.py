"""The adapter configs: one pydantic model per adapter algorithm, told apart by `type` in a
discriminated union, as the optimizer configs are (optimizer_configs.py).

Each algorithm's config is declared in its own file, modules/config/adapters/<algorithm>.py,
with the AdapterModule class it drives (modules/adapters/<algorithm>.py, imported only to train).
This file holds what they share: the fields every adapter has (`AdapterConfigBase`), the option
groups several have (`LowRankOptions`: rank/alpha and their per-part overrides;
`DecompositionOptions`: DoRA), and `ADAPTERS`, the declared union (modules/config/tagged.py), so
an algorithm registered at runtime is a valid `adapter.type` without an edit here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator

from modules.config.limits import MAX_ALPHA, MAX_RANK
from modules.config.strict import StrictModel
from modules.config.tagged import TaggedUnion

DType = Literal["float32", "bfloat16", "float16"]
DoraAxis = Literal["auto", "output", "input"]
DEFAULT_ADAPTER_TYPE = "lora"  # what a config without adapter.type trains


def valid_regexes(patterns: list[str]) -> list[str]:
    for index, pattern in enumerate(patterns):
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"entry {index} ({pattern!r}) is not a valid regex: {error}") from None
    return patterns


def resolve_dora_axis(axis: str, output_format: str) -> Literal["output", "input"]:
    """The axis `auto` stands for with this output format (see DecompositionOptions.dora_axis)."""
    if axis != "auto":
        return axis  # type: ignore[return-value]
    return "output" if output_format == "diffusers" else "input"


class AdapterConfigBase(StrictModel):
    """What every adapter algorithm has: which layers, dropouts, dtype, a start file. An
    algorithm's config subclasses it, the option groups it needs listed first (their methods
    win), and narrows `type` to a Literal of its name."""

    type: str
    dropout: float = Field(0.0, ge=0, lt=1, description="lora: on the rank-sized hidden; the others: on "
                           "the adapter's change of the output.")
    rank_dropout: float = Field(0.0, ge=0, lt=1, description="Drop whole ranks (lora), delta rows (loha, "
                                "lokr) or rotation blocks (oft) while training.")
    module_dropout: float = Field(0.0, ge=0, lt=1, description="Skip a whole adapter for a step with this "
                                  "probability while training.")
    init_from: str | None = Field(
        None, description="Start from this adapter file (kohya/LyCORIS, ComfyUI or diffusers/peft keys, from "
        "this or another trainer) and continue training it; it must fit the adapter configured here.")
    layer_preset: str = Field(
        "attn-mlp", description="A named layer selection of the family (attn, attn-mlp, all-linear, all)."
    )
    layer_filter: list[str] = Field(
        default_factory=list,
        description="Regexes searched in 'part.module.name'; when given, they replace the preset.",
    )
    dtype: DType = Field("float32", description="Dtype of the adapter's own weights while training.")

    @field_validator("layer_filter")
    @classmethod
    def _valid_regexes(cls, patterns: list[str]) -> list[str]:
        return valid_regexes(patterns)

    def size_for(self, part: str) -> tuple[int, float]:
        """(rank, alpha) for a model part; an algorithm without them has neither (0, 0.0)."""
        return 0, 0.0

    def resolved_dora_axis(self, output_format: str) -> Literal["output", "input"] | None:
        """The weight-decomposition axis for this output format; None without decomposition."""
        return None

    @classmethod
    def shared_fields(cls) -> tuple[str, ...]:
        """The fields every algorithm has (the GUI shows them apart from the algorithm's own)."""
        return tuple(AdapterConfigBase.model_fields)


class AdapterPartConfig(StrictModel):
    """Per-part overrides of the adapter's size (`adapter.parts.text_encoder.rank`)."""

    rank: int | None = Field(None, ge=1, le=MAX_RANK, description="None: adapter.rank.")
    alpha: float | None = Field(None, gt=0, le=MAX_ALPHA, description="None: adapter.alpha.")


class LowRankOptions(StrictModel):
    """rank and alpha, and their per-part overrides (the low-rank algorithms)."""

    rank: int = Field(16, ge=1, le=MAX_RANK, description=f"The rank of the low-rank factors (at most {MAX_RANK}).")
    alpha: float = Field(16.0, gt=0, le=MAX_ALPHA,
        description="Output is scaled by alpha / rank (lokr with both factors "
                         "full: scale 1).")
    parts: dict[str, AdapterPartConfig] = Field(
        default_factory=dict, description="Per-part rank/alpha, e.g. {\"text_encoder\": {\"rank\": 8}}.")

    def size_for(self, part: str) -> tuple[int, float]:
        """(rank, alpha) for a model part, its overrides applied."""
        override = self.parts.get(part)
        rank = override.rank if override and override.rank is not None else self.rank
        alpha = override.alpha if override and override.alpha is not None else self.alpha
        return rank, alpha


class DecompositionOptions(StrictModel):
    """Weight decomposition (magnitude and direction, as DoRA), for the algorithms that have it."""

    dora: bool = Field(False, description="Weight decomposition (magnitude and direction): DoRA for lora, "
                       "weight-decomposed LoKr for lokr.")
    dora_axis: DoraAxis = Field(
        "auto", description="The norm DoRA divides by. Exact per consumer: output axis (one norm per output "
        "row) in LyCORIS, peft and diffusers, approximate in ComfyUI (it divides by the base weight's norm); "
        "input axis (one per input column) in ComfyUI, Forge and A1111, refused by LyCORIS's loader and not "
        "writable as diffusers keys. auto: output for output.format 'diffusers', input for 'kohya'/'comfy' "
        "(the tools that load those files).")

    def resolved_dora_axis(self, output_format: str) -> Literal["output", "input"] | None:
        return resolve_dora_axis(self.dora_axis, output_format) if self.dora else None


# --- the union --------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdapterTraits:
    """What an adapter algorithm declares beside its config (register(..., trait=value))."""

    label: str = ""  # its name in menus ("LoHa"); empty: its `type`
    # its name in menus with `dora: true` ("DoRA"); empty: the algorithm has no DoRA entry of its own
    dora_label: str = ""


ADAPTERS = TaggedUnion("adapter", base=AdapterConfigBase, default=DEFAULT_ADAPTER_TYPE, traits=AdapterTraits,
                       package="modules.config.adapters")


def register_adapter_config(config_class: type[AdapterConfigBase], implementation: Any, **traits: Any):
    """Declare an adapter algorithm: its config, its AdapterModule class ("module:attr" or the class)."""
    return ADAPTERS.register(config_class, implementation, **traits)


def adapter_config_classes() -> dict[str, type[AdapterConfigBase]]:
    """The registered algorithms' configs by `type`, the default (lora) first."""
    return {name: member.config_class for name, member in ADAPTERS.members().items()}


def default_adapter_config() -> AdapterConfigBase:
    return ADAPTERS.default_config()


def AdapterConfig(**fields: Any) -> AdapterConfigBase:  # noqa: N802  (reads as the config it builds)
    """The validated config of the algorithm `fields['type']` (lora when not given)."""
    return ADAPTERS.validate(fields)  # type: ignore[return-value]
