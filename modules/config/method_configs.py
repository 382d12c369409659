"""What a run trains, `config.method`: one pydantic model per training method, told apart by `type`
in a discriminated union like the optimizers (the methods themselves are in modules/methods/)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field

from modules.config.strict import StrictModel


class AdapterMethodConfig(StrictModel):
    """Train an adapter (LoRA, LoHa, LoKr, OFT, DoRA: `adapter`) on the trained parts; the base
    weights stay frozen."""

    type: Literal["adapter"] = "adapter"


class FineTuneMethodConfig(StrictModel):
    """Train the trained parts' own weights (a full fine-tune); the run saves the whole model."""

    type: Literal["fine_tune"] = "fine_tune"
    fused_backward: bool = Field(True, description="Step each weight in the backward pass as soon as its "
                                 "gradient is complete and free that gradient: gradient memory is one layer, "
                                 "not the model (needs schedule.gradient_accumulation 1).")
    stochastic_rounding: bool = Field(True, description="bfloat16 weights: round each update stochastically, "
                                      "so updates smaller than bfloat16's spacing are not lost on average.")
    save_format: Literal["auto", "single_file", "diffusers"] = Field(
        "auto", description="What the run saves: single_file (one .safetensors in the original ldm layout "
        "that ComfyUI, A1111 and diffusers' from_single_file load; sd15, sdxl), diffusers (a pipeline folder "
        "named like output.path without .safetensors, for from_pretrained), or auto (single_file where the "
        "family has it, else diffusers).")

    def check_config(self, config) -> None:
        """Refusals that depend on the rest of the config (quantized trained parts, fused-step limits)."""
        from modules.methods.fine_tune_rules import check_fine_tune_config

        check_fine_tune_config(config)


class EmbeddingMethodConfig(StrictModel):
    """Train only the textual-inversion embeddings (`embeddings` with train on); the model's weights
    stay frozen, model.parts.*.train is not read, and the run saves the embedding file(s)."""

    type: Literal["embedding"] = "embedding"


# Each method is its own model with its own options, told apart by `type`; more slot in here.
MethodConfig = Annotated[Union[AdapterMethodConfig, FineTuneMethodConfig, EmbeddingMethodConfig], Field(discriminator="type")]


def default_method_type(data: Any) -> Any:
    if isinstance(data, dict) and "type" not in data:
        return {"type": "adapter", **data}
    return data
