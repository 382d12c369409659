"""The fine-tune method: train the trained parts' own weights (modules/methods/fine_tune.py); its
config, traits, and what it refuses, checked when the config is validated (the GUI shows it at
once), each refusal naming the field to change:

- A trained part's weights must be dense float32 or bfloat16: quantized storage (float8, int8,
  w8a8, nf4) has no weights an optimizer can step, `auto` may pick such a mode, and float16
  weights lose small updates (no stochastic rounding for them) and overflow.
- Layer offloading of a trained part needs the fused backward: a parked block's weights (and
  their optimizer state) are on the train device only around the block's own backward, where the
  fused step runs (modules/offload/trained_tensors.py); an ordinary step after the backward pass
  would find them parked, with their gradients on the train device.
- The fused backward steps each weight once, the moment its gradient is complete, so gradients
  cannot add up over several batches (gradient_accumulation), a float16 loss scaler cannot skip
  a step after the fact, and optimizers whose step reads statistics of all parameters together
  (Prodigy's d, schedule-free's averaging weight) cannot step one parameter at a time. The same
  holds for stochastic rounding of bfloat16 weights, which steps each weight on its own too.
  Gradient clipping (schedule.max_grad_norm) is applied per parameter in a fused step, as kohya's
  and OneTrainer's fused passes do (see modules/optim/fused_backward.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modules.config.errors import located_error
from modules.config.method_configs import MethodConfigBase, register_method_config
from modules.config.optimizer_configs import OPTIMIZERS


class FineTuneMethodConfig(MethodConfigBase):
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

    def steps_in_backward(self) -> bool:
        return self.fused_backward

    def check_config(self, config) -> None:
        """Refusals that depend on the rest of the config (quantized trained parts, fused-step limits)."""
        _check_fine_tune_config(config)


TRAINABLE_WEIGHT_DTYPES = ("float32", "bfloat16")
# families whose parts all have a writer of the original single-file layout (modules/saving/ldm_checkpoint.py)
SINGLE_FILE_FAMILIES = ("sd15", "sdxl")


def _check_fine_tune_config(config) -> None:
    method = config.method
    trained = {name: part for name, part in config.model.parts.items() if part.train}
    for name, part in trained.items():
        if part.weight_dtype not in TRAINABLE_WEIGHT_DTYPES:
            why = {"auto": "auto may pick a quantized mode", "float16": "float16 weights lose small updates "
                   "and overflow"}.get(part.weight_dtype, f"{part.weight_dtype} is quantized storage, which "
                                       "an optimizer cannot step")
            raise located_error(f"a part that a full fine-tune trains needs float32 or bfloat16 weights ({why}); "
                                f"set it to bfloat16 or float32, or train an adapter (method.type: adapter)",
                                "model", "parts", name, "weight_dtype")
        if part.offload_fraction != 0 and not method.fused_backward:
            raise located_error("layer offloading of a part that a full fine-tune trains needs "
                                "method.fused_backward: true (each parked block is stepped in its own backward, "
                                "while its weights are on the train device); turn it on or set this to 0",
                                "model", "parts", name, "offload_fraction")
    stepped_alone = []  # why weights are stepped one at a time
    if method.fused_backward:
        stepped_alone.append("method.fused_backward")
        if config.schedule.gradient_accumulation > 1:
            raise located_error("method.fused_backward steps each weight as soon as its gradient is complete, "
                                "so gradients cannot add up over batches; set this to 1 or turn "
                                "method.fused_backward off", "schedule", "gradient_accumulation")
        if config.train_dtype == "float16":
            raise located_error("float16 training needs a loss scaler that skips steps after looking at every "
                                "gradient, which method.fused_backward cannot wait for; use bfloat16 or "
                                "float32, or turn method.fused_backward off", "train_dtype")
    if method.stochastic_rounding and any(p.weight_dtype == "bfloat16" for p in trained.values()):
        stepped_alone.append("method.stochastic_rounding with bfloat16 weights")
    why = OPTIMIZERS.traits(config.optimizer.type).needs_whole_step
    if stepped_alone and why:
        raise located_error(f"{why}, so it cannot step one weight at a time as {' and '.join(stepped_alone)} "
                            "do; choose another optimizer or turn those off", "optimizer", "type")
    if method.save_format == "single_file" and config.model.family not in SINGLE_FILE_FAMILIES:
        raise located_error(f"a single file in the original layout is written for "
                            f"{', '.join(SINGLE_FILE_FAMILIES)} only, not {config.model.family}; "
                            "choose diffusers (or auto)", "method", "save_format")
    _check_frozen_quantized_parts(config, SINGLE_FILE_FAMILIES)


def _check_frozen_quantized_parts(config, single_file_families: tuple[str, ...]) -> None:
    """A frozen part kept quantized is saved by copying its original weights from the base, which
    must hold them in the layout written (modules/saving/model_files.py); `auto` is checked once
    resolved, before training."""
    from modules.loading.single_file import is_single_file

    save_format = config.method.save_format
    single_file = save_format == "single_file" or (save_format == "auto" and config.model.family in single_file_families)
    for name, part in config.model.parts.items():
        if part.train or part.weight_dtype in TRAINABLE_WEIGHT_DTYPES + ("float16", "auto"):
            continue
        from_single_file = is_single_file(config.model.base) and not part.path
        if from_single_file != single_file:
            layout = "a single file" if single_file else "a diffusers folder"
            raise located_error(f"{name} is kept quantized, so the saved model copies its original weights "
                                f"from the base, which does not hold them as {layout} (method.save_format); "
                                "keep it dense or choose the other save_format", "model", "parts", name, "weight_dtype")


register_method_config(FineTuneMethodConfig, "modules.methods.fine_tune:FineTuneMethod",
                       trains_model_weights=True)
