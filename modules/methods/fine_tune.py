"""The full fine-tune: the trained parts' own weights are the parameters (their storage dtype,
float32 or bfloat16, is the training dtype). Optional, from `method`: a fused backward pass
(modules/optim/fused_backward.py) and stochastic rounding of bfloat16 weights
(modules/optim/rounded_step.py); the output is the whole model, a single file in the original
layout or a diffusers folder (modules/saving/model_files.py). What is refused is in
modules/config/methods/fine_tune.py (checked with the config).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from modules.config.errors import ConfigError
from modules.config.train_config import TrainConfig
from modules.methods.base import TrainingMethod
from modules.methods.reachable_weights import reachable_text_weights
from modules.optim.fused_backward import FusedBackward
from modules.optim.rounded_step import keep_float32_state, step_bfloat16_stochastically
from modules.optim.single_parameter_step import SingleParameterStepper
from modules.saving.model_files import uncopyable_parts, write_pipeline_folder, write_single_file
from modules.saving.output_folder import folder_for, resolve_output_folder
from modules.util.sharded_tensors import copy_into_shard_, full_value


def single_file_output(config: TrainConfig) -> bool:
    from modules.saving.ldm_checkpoint import single_file_families

    save_format = config.method.save_format
    return save_format == "single_file" or (save_format == "auto" and config.model.family in single_file_families())


class FineTuneMethod(TrainingMethod):
    name = "fine_tune"
    state_prefix = "fine_tune."
    saves_model_weights = True

    fused: FusedBackward | None = None

    def trained_parts(self) -> list[str]:
        # the parts the diffusion loss reaches (the same ones an adapter could go on; not the VAE)
        return [name for name, part in self.config.model.parts.items()
                if part.train and self.family.spec(name).adapter_prefix]

    def setup(self) -> None:
        single_file = single_file_output(self.config)
        refused = uncopyable_parts(self.family, single_file)
        if refused:
            layout = "a single file" if single_file else "a diffusers folder"
            raise ConfigError([f"model.parts.{part}.weight_dtype: {part} is kept quantized and its original "
                               f"weights are not in {layout}, which method.save_format writes; keep it dense "
                               f"or choose the other save_format" for part in refused])
        if not single_file:  # output.if_exists applies to the folder, before training
            trainer, config = self.trainer, self.config
            self.output_folder = resolve_output_folder(trainer.output_path, config.output.if_exists, trainer.workspace,
                                                       config.backup.resume, trainer.callbacks.on_warning)
        self.named = []
        # what the first step rightly leaves without gradient (a zero gate's modules), judged before it
        self.zero_gated = tuple(f"{part}.{prefix}" for part in self.trained_parts()
                                for prefix in self.family.zero_gated_prefixes(part))
        for part in self.trained_parts():
            # a text encoder's weights after the hidden state the family reads never get a gradient
            reachable = reachable_text_weights(self.family, part) if part in self.family.text_parts else None
            unreachable = self.family.unreachable_prefixes(part)  # e.g. a denoiser's last text-stream layers
            left_out = []
            for name, parameter in self.family.parts[part].named_parameters():
                trains = (reachable is None or id(parameter) in reachable) and not (
                    unreachable and name.startswith(unreachable))
                parameter.requires_grad_(trains)
                if trains:
                    self.named.append((f"{part}.{name}", parameter))
                else:
                    left_out.append(name)
            if left_out:
                self.trainer.callbacks.on_status(f"model.parts.{part}: {len(left_out)} weight(s) do not reach the "
                                                 f"loss and stay frozen ({', '.join(left_out[:3])}, ...)")
        if self.config.method.fused_backward:
            self.fused = FusedBackward(self.named, self.config.schedule.max_grad_norm)

    def parameters_replaced(self) -> None:
        current = {f"{part}.{name}": p for part in self.trained_parts()
                   for name, p in self.family.parts[part].named_parameters()}
        self.named = [(name, current[name]) for name, _ in self.named]

    def optimizer_ready(self, optimizer: torch.optim.Optimizer) -> None:
        stepper = self.stepper = SingleParameterStepper(optimizer, self.config.method.stochastic_rounding)
        keep_float32_state(stepper)
        for conductor in self.trainer.conductors.values():  # the state of parked weights parks with them
            conductor.carry_optimizer_state(optimizer)
        if self.fused is not None:
            self.fused.attach(stepper)
        elif stepper.stochastic_rounding:
            step_bfloat16_stochastically(stepper)

    def steps_in_backward(self) -> bool:
        return self.fused is not None

    def gradients_seen(self) -> dict[str, bool] | None:
        return self.fused.take_gradients_seen() if self.fused is not None else None

    def recorded_moves(self) -> dict[str, bool] | None:
        moves = self.stepper.take_moves()
        return {name: moves[id(p)] for name, p in self.named if id(p) in moves}

    def record_moves(self, names: set[str]) -> None:
        self.stepper.record_moves({id(p) for name, p in self.named if name in names})

    def stepped_parameters(self, optimizer: torch.optim.Optimizer) -> set[int]:
        if self.fused is None:
            return super().stepped_parameters(optimizer)
        # the fused backward steps what its stepper's groups held when it was made (single_parameter_step.py)
        return {id(p) for _, p in self.named if id(p) in self.fused.stepper.group_of}

    def parameter_groups(self, config: TrainConfig) -> list[dict]:
        groups = []
        for part in self.trained_parts():
            params = [p for name, p in self.named if name.startswith(part + ".")]
            if params:
                groups.append({"params": params, "lr": config.model.parts[part].learning_rate or config.optimizer.lr,
                               "name": part})
        return groups

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.named)

    def guarded_parameters(self) -> list[tuple[str, nn.Parameter]]:
        not_run = self.family.trained_parts_not_run()  # an expert no sample reached yet has no gradient
        return [(n, p) for n, p in self.named
                if n.split(".", 1)[0] not in not_run and not (self.zero_gated and n.startswith(self.zero_gated))]

    def state_dict(self) -> dict[str, torch.Tensor]:
        # a sharded weight whole (every rank gathers it together): backups are a single process's
        return {name: full_value(parameter.detach()) for name, parameter in self.named}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor], source: str) -> None:
        own = dict(self.named)
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ConfigError([f"backup.resume: {source} does not fit the trained weights of this run "
                               f"(missing: {', '.join(missing[:5]) or 'none'}; unexpected: "
                               f"{', '.join(unexpected[:5]) or 'none'})"])
        for name, parameter in own.items():
            if state[name].shape != parameter.shape:
                raise ConfigError([f"backup.resume: {source}: {name} has shape {tuple(state[name].shape)}, "
                                   f"the model {tuple(parameter.shape)}"])
            copy_into_shard_(parameter, state[name])  # (a sharded weight keeps this rank's slice)

    def save(self, path: Path, dtype: torch.dtype, metadata: dict[str, str]) -> list[Path]:
        metadata = {**metadata, "difftrainer.steps": str(self.trainer.step),
                    "difftrainer.trained_parts": ",".join(self.trained_parts())}
        if single_file_output(self.config):
            return [write_single_file(Path(path), self.family, dtype, metadata)]
        folder = self.output_folder if Path(path) == self.trainer.output_path else folder_for(path)
        return [write_pipeline_folder(folder, self.family, self.trained_parts(), dtype, metadata)]

    @classmethod
    def planned_size(cls, config: TrainConfig, family):
        from modules.methods.fine_tune_size import fine_tune_size

        return fine_tune_size(config, family, single_file_output(config))
