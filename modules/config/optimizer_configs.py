"""The optimizer configs: one pydantic model per optimizer with its own parameters, told apart by
`type` in a discriminated union (the builders are in modules/optim/optimizers.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args

from pydantic import Field

from modules.config.limits import MAX_EPSILON, MAX_LEARNING_RATE, MAX_STEPS, MAX_WEIGHT_DECAY
from modules.config.strict import StrictModel

Beta = Annotated[float, Field(ge=0, lt=1)]
Betas = tuple[Beta, Beta]
Epsilon = Annotated[float, Field(gt=0, le=MAX_EPSILON)]


class AdamWConfig(StrictModel):
    type: Literal["adamw"] = "adamw"
    lr: float = Field(1e-4, gt=0, le=MAX_LEARNING_RATE,
        description="The learning rate (a part's own learning_rate overrides it).")
    betas: Betas = Field((0.9, 0.999), description="Decay rates of the moment estimates.")
    eps: float = Field(1e-8, gt=0, le=MAX_EPSILON, description="Added to denominators for numerical stability.")
    weight_decay: float = Field(1e-2, ge=0, le=MAX_WEIGHT_DECAY, description="Decoupled weight decay.")


class AdamW8bitConfig(AdamWConfig):
    """bitsandbytes' AdamW with 8-bit (blockwise quantized) moments: ~1/4 of AdamW's state memory;
    AdamW's parameters."""

    type: Literal["adamw_8bit"] = "adamw_8bit"


class AdafactorConfig(StrictModel):
    """torch.optim.Adafactor: factored second moments, no first moment (very little state)."""

    type: Literal["adafactor"] = "adafactor"
    lr: float = Field(1e-2, gt=0, le=MAX_LEARNING_RATE,
        description="The learning rate (a part's own learning_rate overrides it).")
    beta2_decay: float = Field(-0.8, ge=-10, lt=0, description="Exponent of the second-moment decay schedule.")
    eps: tuple[Epsilon | None, Epsilon] = Field((None, 1e-3), description="Regularisation of the squared gradient and "
                                            "of the update's RMS; None: the dtype's own epsilon.")
    d: float = Field(1.0, gt=0, le=1000, description="Clipping threshold of the update's RMS.")
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY, description="Decoupled weight decay.")


class ProdigyConfig(StrictModel):
    """Prodigy (prodigyopt): estimates the step size itself; lr is a multiplier, 1.0 as a rule."""

    type: Literal["prodigy"] = "prodigy"
    lr: float = Field(1.0, gt=0, le=MAX_LEARNING_RATE,
        description="The learning rate (a part's own learning_rate overrides it).")
    betas: Betas = Field((0.9, 0.999), description="Decay rates of the moment estimates.")
    beta3: float | None = Field(None, ge=0, lt=1, description="None: sqrt(beta2).")
    eps: float = Field(1e-8, gt=0, le=MAX_EPSILON, description="Added to denominators for numerical stability.")
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY, description="Decoupled weight decay.")
    decouple: bool = Field(True, description="AdamW-style decoupled weight decay.")
    use_bias_correction: bool = Field(False, description="Adam bias correction of the step-size estimate.")
    safeguard_warmup: bool = Field(False, description="Keep the step-size estimate from growing too fast "
                                   "during lr warmup.")
    d_coef: float = Field(1.0, gt=0, le=1000, description="Multiplies the estimated step size.")
    d0: float = Field(1e-6, gt=0, le=1, description="Initial step-size estimate.")


class ScheduleFreeAdamWConfig(StrictModel):
    """Schedule-free AdamW (schedulefree): no LR schedule needed (use lr_scheduler constant); samples
    and saves use its averaged weights."""

    type: Literal["schedule_free_adamw"] = "schedule_free_adamw"
    lr: float = Field(2.5e-3, gt=0, le=MAX_LEARNING_RATE,
        description="The learning rate (a part's own learning_rate overrides it).")
    betas: Betas = Field((0.9, 0.999), description="Decay rates of the moment estimates.")
    eps: float = Field(1e-8, gt=0, le=MAX_EPSILON, description="Added to denominators for numerical stability.")
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY, description="Decoupled weight decay.")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Steps of the optimizer's own warmup.")


class LionConfig(StrictModel):
    """Lion (lion-pytorch): sign updates, one moment; wants ~3-10x smaller lr than AdamW."""

    type: Literal["lion"] = "lion"
    lr: float = Field(3e-5, gt=0, le=MAX_LEARNING_RATE,
        description="The learning rate (a part's own learning_rate overrides it).")
    betas: Betas = Field((0.9, 0.99), description="Decay rates of the moment estimates.")
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY, description="Decoupled weight decay.")


class CAMEConfig(StrictModel):
    """CAME (came-pytorch): confidence-guided, factored, memory-light."""

    type: Literal["came"] = "came"
    lr: float = Field(1e-4, gt=0, le=MAX_LEARNING_RATE,
        description="The learning rate (a part's own learning_rate overrides it).")
    betas: tuple[Beta, Beta, Beta] = Field((0.9, 0.999, 0.9999), description="Decay rates of the moment "
                                              "estimates.")
    eps: tuple[Epsilon, Epsilon] = Field((1e-30, 1e-16), description="Added to denominators for numerical stability.")
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY, description="Decoupled weight decay.")


# Each optimizer is its own model with its own parameters, told apart by `type`; more slot in here.
OptimizerConfig = Annotated[
    Union[AdamWConfig, AdamW8bitConfig, AdafactorConfig, ProdigyConfig, ScheduleFreeAdamWConfig, LionConfig,
          CAMEConfig],
    Field(discriminator="type"),
]


def union_tags(union: Any) -> frozenset[str]:
    members = get_args(union)[0]  # Annotated[Union[...], Field] -> Union[...] (or the one member)
    return frozenset(m.model_fields["type"].default for m in (get_args(members) or (members,)))


# The `type` tags of the discriminated unions, so error paths can leave them out (errors.py).
UNION_TAGS = union_tags(OptimizerConfig)


def default_optimizer_type(data: Any) -> Any:
    if isinstance(data, dict) and "type" not in data:
        return {"type": "adamw", **data}
    return data
