"""GenericTrainer: one training run, in the order DESIGN.md gives.

start():  validate paths, snapshot the config, load the model through its family, set up each
          part, move parts to the train device, build adapters + optimizer (+ resume), data.
train():  epochs of batches; optimizer steps on accumulation boundaries, where timed actions
          (sample, backup, save) and commands (stop, sample now, ...) also run.
end():    final save.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from modules.adapters.adapter_set import AdapterSet, build_adapter_set
from modules.adapters.formats.kohya import save_kohya_lora
from modules.config.train_config import TrainConfig
from modules.data.concepts import check_concepts
from modules.data.dataset import Batch, TrainDataset, prepare_dataset
from modules.model.registry import get_family_class
from modules.optim.optimizers import build_optimizer
from modules.optim.schedulers import build_scheduler
from modules.sampling.sampler import sample_prompts
from modules.saving.atomic import write_text
from modules.saving.backup import newest_backup, read_backup, write_backup
from modules.trainer.callbacks import Progress, TrainCallbacks
from modules.trainer.commands import TrainCommands
from modules.trainer.guards import TrainingError, check_finite, check_first_step, snapshot
from modules.trainer.resume import check_resume_compatible
from modules.trainer.scalar_log import ScalarLog
from modules.trainer.timed_actions import TimedAction
from modules.util.torch_utils import autocast, dtype_of, resolve_device


class GenericTrainer:
    def __init__(self, config: TrainConfig, callbacks: TrainCallbacks | None = None,
                 commands: TrainCommands | None = None):
        self.config = config
        self.callbacks = callbacks or TrainCallbacks()
        self.commands = commands or TrainCommands()
        self.workspace = Path(config.workspace_dir)
        self.cache_dir = Path(config.cache_dir) if config.cache_dir else self.workspace / "cache"
        self.device = resolve_device(config.train_device)
        self.step = 0  # optimizer steps done
        self.epoch = 0
        self.batch_in_epoch = 0  # batches of `epoch` already trained
        self.last_loss = float("nan")
        self.family = None
        self.adapters: AdapterSet | None = None
        self.dataset: TrainDataset | None = None

    # --- start -------------------------------------------------------------------------------

    def start(self) -> None:
        config = self.config
        check_concepts(config.concepts)  # before the slow model load
        self.callbacks.on_status("loading model")
        self.workspace.mkdir(parents=True, exist_ok=True)
        write_text(self.workspace / "config.json", config.model_dump_json(indent=2))
        torch.manual_seed(config.seed)
        self.family = get_family_class(config.model.family)(config)
        self.trained_parts = [name for name, part in config.model.parts.items()
                              if part.train and self.family.spec(name).adapter_prefix]
        if not self.trained_parts:
            raise TrainingError("model.parts: no part that carries adapters has train: true (nothing to train)")
        self.family.load()
        self.setup_optimizations()
        self.setup_train_device()
        self.setup_model()
        self.callbacks.on_status("caching latents and text")
        self.setup_data()
        self.sample_action = TimedAction(config.schedule.sample_every)
        self.backup_action = TimedAction(config.schedule.backup_every)
        self.save_action = TimedAction(config.schedule.save_every)
        self.scalars = ScalarLog(self.workspace / "tensorboard", config.tensorboard)

    def setup_optimizations(self) -> None:
        """Per part: weight dtypes are applied at load; gradient checkpointing and quantization slot in here."""

    def setup_train_device(self) -> None:
        self.family.to(self.device)

    def setup_model(self) -> None:
        config = self.config
        self.adapters = build_adapter_set(self.family, config.adapter, self.trained_parts, self.device)
        for part in self.trained_parts:
            self.family.parts[part].train()
        groups = []
        for part in self.trained_parts:
            params = self.adapters.parameters(part)
            if params:
                lr = config.model.parts[part].learning_rate or config.optimizer.lr
                groups.append({"params": params, "lr": lr, "name": part})
        self.optimizer = build_optimizer(config.optimizer, groups)
        # float16 gradients underflow without loss scaling; for other dtypes the scaler is a no-op
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.train_dtype == "float16")
        self.resume_state = self._load_resume_state() if config.backup.resume else None

    def setup_data(self) -> None:
        # text conditioning can be cached only while no text encoder trains
        cache_text = not any(self.config.model.parts[p].train for p in self.family.text_parts)
        self.dataset = prepare_dataset(self.config, self.family, self.device, self.cache_dir,
                                       self.callbacks.on_warning, cache_text)
        (latent_hits, latent_misses), (text_hits, text_misses) = (
            self.dataset.cache_stats["latents"], self.dataset.cache_stats["text"])
        self.callbacks.on_status(f"{len(self.dataset.entries)} images; cache: {latent_misses} latents and "
                                 f"{text_misses} captions encoded, {latent_hits + text_hits} entries reused")
        schedule = self.config.schedule
        # accumulation groups end with the epoch, so every epoch has the same number of steps
        self.steps_per_epoch = -(-len(self.dataset.epoch_batches(0)) // schedule.gradient_accumulation)
        self.total_steps = schedule.epochs * self.steps_per_epoch
        if schedule.max_steps:
            self.total_steps = min(self.total_steps, schedule.max_steps)
        self.scheduler = build_scheduler(self.config.lr_scheduler, self.optimizer, self.total_steps)
        self.generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        if self.resume_state is not None:
            self._restore(self.resume_state)

    # --- resume ------------------------------------------------------------------------------

    def _load_resume_state(self) -> dict | None:
        folder = newest_backup(self.workspace)
        if folder is None:
            self.callbacks.on_warning(f"backup.resume: no backup in {self.workspace / 'backup'}; starting from step 0")
            return None
        adapter_state, state, config_json = read_backup(folder)
        check_resume_compatible(config_json, self.config, folder)
        self.adapters.load_state_dict(adapter_state, source=str(folder / "adapter.safetensors"))
        self.callbacks.on_status(f"resuming from {folder}")
        return state

    def _restore(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]

    def _training_state(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
        }

    # --- train -------------------------------------------------------------------------------

    def train(self) -> None:
        config, schedule = self.config, self.config.schedule
        accumulation = schedule.gradient_accumulation
        params = self.adapters.parameters()
        compute_dtype = dtype_of(config.train_dtype)
        scaler = self.scaler
        first_step_snapshot = snapshot(self.adapters.named_parameters())
        self.callbacks.on_started(self.total_steps)
        self.callbacks.on_status("training")
        started, steps_at_start = time.monotonic(), self.step
        while self.step < self.total_steps and self.epoch < schedule.epochs and not self.commands.stop_requested:
            batches = self.dataset.epoch_batches(self.epoch)
            if self.batch_in_epoch >= len(batches):  # resumed into a data set that has shrunk since
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                continue
            while self.batch_in_epoch < len(batches) and self.step < self.total_steps:
                group = min(accumulation, len(batches) - self.batch_in_epoch)
                loss_sum = torch.zeros((), device=self.device)
                for _ in range(group):
                    loss = self._forward(batches[self.batch_in_epoch], compute_dtype)
                    scaler.scale(loss / group).backward()
                    loss_sum += loss.detach()
                    self.batch_in_epoch += 1
                self.last_loss = float(loss_sum) / group
                check_finite(self.last_loss, self.step + 1)
                scaler.unscale_(self.optimizer)
                if schedule.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(params, schedule.max_grad_norm)
                scale = scaler.get_scale()
                scaler.step(self.optimizer)
                scaler.update()
                self.scheduler.step()
                skipped = scaler.get_scale() < scale  # the scaler skipped a step with inf/nan gradients
                if first_step_snapshot is not None and not skipped:
                    check_first_step(self.adapters.named_parameters(), first_step_snapshot)
                    first_step_snapshot = None
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                epoch_finished = self.batch_in_epoch >= len(batches)
                if epoch_finished:
                    self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                self._report(started, steps_at_start)
                self._on_boundary(epoch_finished)
                if self.commands.stop_requested or epoch_finished:
                    break
        if self.commands.stop_requested:
            self.callbacks.on_status("stopping: writing a backup")
            self.backup()

    def _forward(self, indices: list[int], compute_dtype: torch.dtype) -> torch.Tensor:
        batch = self.dataset.collate(indices, self.device)
        with autocast(self.device, compute_dtype):
            prediction, target = self.family.predict(batch.latents, self.conditioning(batch), self.generator)
        return F.mse_loss(prediction.float(), target.float())

    def conditioning(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The batch's cached text conditioning, or a fresh encoding when a text encoder trains."""
        if batch.text is not None:
            return batch.text
        return self.family.encode_text(self.family.tokenize(batch.captions))

    def _report(self, started: float, steps_at_start: int) -> None:
        elapsed = time.monotonic() - started
        done = self.step - steps_at_start
        rate = done / elapsed if elapsed > 0 else 0.0
        lr = self.scheduler.get_last_lr()[0]
        self.callbacks.on_progress(Progress(
            step=self.step, total_steps=self.total_steps, epoch=self.epoch, epochs=self.config.schedule.epochs,
            loss=self.last_loss, lr=lr, it_per_s=rate,
            eta_s=(self.total_steps - self.step) / rate if rate > 0 else float("inf"),
        ))
        self.scalars.add(self.step, loss=self.last_loss, lr=lr)

    def _on_boundary(self, epoch_finished: bool) -> None:
        requested = self.commands.take()
        for name, action, run in (("sample", self.sample_action, self.sample),
                                  ("backup", self.backup_action, self.backup),
                                  ("save", self.save_action, self.save)):
            if name in requested or action.due(self.step, epoch_finished, self.epoch):
                run()
                action.done()

    # --- actions -----------------------------------------------------------------------------

    def sample(self) -> list[Path]:
        if not self.config.sampling.prompts:
            self.callbacks.on_warning("sampling.prompts: no prompt to sample")
            return []
        self.callbacks.on_status("sampling")
        paths = sample_prompts(self.family, self.config.sampling.prompts, self.workspace / "samples", self.step, self.device)
        for path in paths:
            self.callbacks.on_sample(str(path))
        return paths

    def backup(self) -> Path:
        folder = write_backup(self.workspace, self.step, self.adapters.state_dict(), self._training_state(),
                              json.loads(self.config.model_dump_json()), self.config.backup.rolling_count)
        self.callbacks.on_backup(str(folder))
        return folder

    def save(self, path: Path | None = None) -> Path:
        output = self.config.output
        if path is None:
            target = Path(output.path)
            path = self.workspace / "save" / f"{target.stem}-step{self.step:07d}{target.suffix}"
        family = self.family
        metadata = {
            "ss_network_module": "networks.lora",
            "ss_network_dim": str(self.config.adapter.rank),
            "ss_network_alpha": str(self.config.adapter.alpha),
            "ss_base_model_version": family.kohya_base_version,
            "ss_sd_model_name": Path(self.config.model.base).name,
            "ss_steps": str(self.step),
            "ss_epoch": str(self.epoch),
            "modelspec.architecture": family.modelspec_architecture,
            "difftrainer.family": family.name,
        }
        saved = save_kohya_lora(path, self.adapters.state_dict(), dtype_of(output.dtype), metadata)
        self.callbacks.on_save(str(saved))
        return saved

    # --- end ---------------------------------------------------------------------------------

    def end(self) -> Path:
        path = self.save(Path(self.config.output.path))
        self.scalars.close()
        self.callbacks.on_finished()
        return path
