"""GenericTrainer: one training run, in the order docs/architecture.md ("The lifecycle of a run") gives.

start():  validate paths, snapshot the config, load the model through its family, set up each
          part, move parts to the train device, set up the training methods (modules/methods/:
          what is trained) + optimizer (+ resume), data.
train():  epochs of batches; optimizer steps on accumulation boundaries, where timed actions
          (sample, backup, save) and commands (stop, sample now, ...) also run.
end():    final save.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial
from pathlib import Path

import torch

from modules.adapters.formats.adopt import adopt_init_from
from modules.config.errors import ConfigError
from modules.config.train_config import SamplePromptConfig, TrainConfig
from modules.data.concepts import check_concepts
from modules.data.dataset import Batch, TrainDataset, caches_text, prepare_dataset
from modules.data.prefetch import BatchPrefetcher
from modules.data.shares import batch_share
from modules.methods.base import TrainingMethod, build_methods
from modules.config.families import get_family_class
from modules.offload.conductor import LayerOffloadConductor
from modules.offload.host_tables import HostTable
from modules.optim.ema import EMA
from modules.optim.optimizers import build_optimizer, evaluation_weights
from modules.optim.schedulers import build_scheduler, warmup_note
from modules.util.atomic import write_text
from modules.saving.backup import remove_unfinished_backups
from modules.saving.output_target import record_output, resolve_output
from modules.saving.workspace_lock import WorkspaceLock
from modules.trainer.command_inbox import CommandInbox
from modules.trainer.event_protocol import apply_command
from modules.trainer.callbacks import Progress, TrainCallbacks
from modules.trainer.commands import TrainCommands
from modules.trainer.cpu_notice import cpu_notice
from modules.trainer.distributed import join_process_group, rank_device
from modules.trainer.first_step_guard import FirstStepGuard
from modules.trainer.guards import TrainingError, check_finite
from modules.trainer.loss import snr_weighting_requested, training_loss
from modules.trainer import outputs
from modules.trainer import background_plan
from modules.trainer.background_plan import BackgroundPlan
from modules.trainer.memory_report import MemoryReport
from modules.trainer.part_setup import setup_optimizations, setup_train_device
from modules.trainer.planned_autos import resolve_planned_autos
from modules.trainer.preflight import run_preflight
from modules.trainer.idle_parts import IdlePart, idle_parts_woken, rest_idle_parts
from modules.trainer.resting_parts import resting_parts_woken
from modules.trainer.tensorboard_log import TensorBoardLog
from modules.trainer.sdpa import with_pinned_sdpa
from modules.trainer.sample_now import sample_requested
from modules.trainer.sharding import clip_grad_norm_ as sharded_clip_grad_norm_
from modules.trainer.sharding import reshard_, shard_parts_
from modules.util.memory import process_memory
from modules.util.sharded_tensors import is_sharded
from modules.trainer.timed_actions import TimedAction
from modules.trainer.training_state import check_resume_early, load_resume_state, restore_training_state
from modules.trainer.weight_modes import quantize_device, resolve_weight_modes
from modules.util.stopping import StopRequested
from modules.util.torch_utils import autocast, dtype_of, make_generator


class GenericTrainer:
    def __init__(self, config: TrainConfig, callbacks: TrainCallbacks | None = None,
                 commands: TrainCommands | None = None):
        self.config = config
        self.callbacks = callbacks or TrainCallbacks()
        self.commands = commands or TrainCommands()
        self.workspace = Path(config.workspace_dir)
        self.cache_dir = Path(config.cache_dir) if config.cache_dir else self.workspace / "cache"
        self.ranks = join_process_group(config.train_device)  # one process: rank 0 of 1 (distributed.py)
        self.device = rank_device(config.train_device, self.ranks)
        self._stop_agreed = False  # several processes: the stop they agreed on at the last step
        self.step = 0  # optimizer steps done
        self._backed_up = False  # whether this process wrote a backup yet
        self.steps_at_start = 0  # of them, those done before this process (a resume)
        self.lock = WorkspaceLock(self.workspace, self.callbacks.on_warning)
        self.output_path = config.output_path  # settled in start(): output.if_exists may version it
        self.tensorboard: TensorBoardLog | None = None
        self.backup_config: dict | None = None  # the config a resumed backup was written with
        self.resume_folder: Path | None = None  # the backup resumed from
        self.epoch = 0
        self.batch_in_epoch = 0  # batches of `epoch` already trained
        self.last_loss = float("nan")
        self.family = None
        self.methods: list[TrainingMethod] = []  # config.method first, then its companions
        self.ema: EMA | None = None
        self.conductors: dict[str, LayerOffloadConductor] = {}  # of the parts the training step runs
        self.host_tables: dict[str, HostTable] = {}  # frozen text encoders' token tables on the host (part_setup.py)
        self.idle_parts: list[IdlePart] = []  # parts the step never runs, off the train device (idle_parts.py)
        self.text_cached = False  # whether the step reads the text from the cache (setup_data)
        self.sharded: list[str] = []  # parts split across the processes (sharding.py)
        self.trains_sharded = False  # whether some of them are trained (a fine-tune)
        self.dataset: TrainDataset | None = None
        self.batches: BatchPrefetcher | None = None  # the dataset's batches, assembled ahead on a thread
        self.inbox: CommandInbox | None = None  # commands from files in the workspace (command_inbox.py)
        self.plan: dict | None = None  # the run's plan (modules/plan/), where preflight or an auto made one
        self.rss_before_load: int | None = None  # resident bytes as the load began (the memory event's baseline)
        self.background_plan: BackgroundPlan | None = None  # the plan made while loading where preflight made none

    # --- start -------------------------------------------------------------------------------

    def start(self) -> None:
        # checkpointing and batch `auto` decided by the plan (planned_autos.py), before anything reads them
        config, plan = resolve_planned_autos(self.config, self.device, self.ranks, self.callbacks.on_status)
        self.config = config
        # every problem the config alone shows, together, before the slow model load (and its estimates)
        self.plan = run_preflight(config, self.callbacks.on_status, plan)  # the memory event shows it
        adopt_init_from(config, self.callbacks.on_warning)  # the start file's layout (adapters/formats/adopt.py)
        check_concepts(config.concepts)  # before the slow model load
        if self.ranks.main:  # the workspace is rank 0's; the other ranks only read (caches, backups)
            self.lock.acquire()  # before anything is written into the workspace
            # the second command channel, for a window that did not start the run: read while the
            # lock says this run owns the workspace, never by a run the lock refused
            self.inbox = CommandInbox(self.workspace, partial(apply_command, commands=self.commands),
                                      self.callbacks.on_warning).open()
            removed = remove_unfinished_backups(self.workspace)
            if removed:
                self.callbacks.on_status(f"removed {removed} unfinished backup folder(s) of an interrupted run")
            self.output_path = resolve_output(config.output_path, config.output.if_exists, self.workspace,
                                              config.backup.resume, self.callbacks.on_warning,
                                              outputs.saved_suffixes(config))
        if config.backup.resume:
            check_resume_early(self)
        if self.ranks.main:  # where preflight skipped the plan (the device surely fits): made beside the load
            self.background_plan = background_plan.start_background_plan(config, self.device, self.plan is not None)
        self.callbacks.on_status("loading model")
        self.rss_before_load = process_memory().get("rss")  # the plan's host figures are growth over this
        if self.ranks.main:
            write_text(self.workspace / "config.json", config.model_dump_json(indent=2))
        torch.manual_seed(config.seed)
        self.family = get_family_class(config.model.family)(config)
        try:
            self.methods = build_methods(self)
        except ValueError as error:
            raise ConfigError([str(error)]) from None
        self.trained_parts = list(dict.fromkeys(p for m in self.methods for p in m.trained_parts()))
        if not self.trained_parts:
            raise TrainingError(f"model.parts: no part that the {config.method.type} method can train has "
                                f"train: true (nothing to train)")
        weighting = snr_weighting_requested(config.loss)
        if weighting and self.family.flow_matching:
            raise ConfigError([f"{weighting}: SNR weighting is for epsilon and v-prediction models; "
                               f"{config.model.family} trains with flow matching"])
        self.family.weight_modes = self.resolve_weight_modes()
        self.family.quantize_device = quantize_device(self)  # each quantized layer on the train device
        self.family.load()
        if self.stopping:
            return self._stopped_while_loading()
        for part, report in self.family.quantization_reports.items():
            self.callbacks.on_status(report.summary(part))
        self.setup_optimizations()
        self.setup_train_device()
        self.setup_model()
        if self.stopping:
            return self._stopped_while_loading()
        self.callbacks.on_status("caching latents and text")
        try:
            self.setup_data()
        except StopRequested:  # asked between two cached batches: what was encoded stays for the next run
            self.dataset = None
            return self._stopped_while_loading()
        self.idle_parts = rest_idle_parts(self, self.text_cached)  # the caches are filled: what only they ran leaves
        self.sample_action = TimedAction(config.schedule.sample_every)
        self.backup_action = TimedAction(config.schedule.backup_every)
        self.save_action = TimedAction(config.schedule.save_every)
        self.validate_action = TimedAction(config.schedule.validate_every)
        self.tensorboard = TensorBoardLog(self.workspace / "tensorboard", config.tensorboard and self.ranks.main)

    def _stopped_while_loading(self) -> None:
        """A stop (Ctrl-C, the GUI) before training: nothing more is loaded; train() and end() then do
        nothing, so no untrained adapter is saved or backed up."""
        self.callbacks.on_status("stopped before the first step: nothing is saved")

    def resolve_weight_modes(self) -> dict[str, str]:
        return resolve_weight_modes(self)

    def setup_optimizations(self) -> None:
        setup_optimizations(self)  # part_setup.py: checkpointing and compile, per part

    def setup_train_device(self) -> None:
        self.conductors = setup_train_device(self)  # part_setup.py: each part onto the train device

    @contextlib.contextmanager
    def evaluation_weights(self):
        """The adapter weights samples and saved files use: the EMA when on, and a schedule-free
        optimizer's averaged point; the trained values come back after."""
        if self.sharded:  # the next forward gathers what the slices hold then (sharding.py)
            reshard_(self)
        try:
            with evaluation_weights(self.optimizer), (self.ema.swapped_in() if self.ema else contextlib.nullcontext()):
                yield
        finally:
            if self.sharded:
                reshard_(self)

    @contextlib.contextmanager
    def offload_paused(self):
        """Every offloaded block parked while sampling (the pipeline needs the room and runs its own
        forward-only passes), and the next step's first blocks brought back after."""
        for conductor in self.conductors.values():
            conductor.evict()
        try:
            # a part only sampling runs comes over for it (resting_parts.py), one the step does not run back
            with resting_parts_woken(self), idle_parts_woken(self):
                yield
        finally:
            for conductor in self.conductors.values():
                conductor.materialize()

    @property
    def adapters(self):
        """The adapter method's AdapterSet (None in a run that trains no adapter)."""
        return next((m.adapters for m in self.methods if hasattr(m, "adapters")), None)

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        return [p for method in self.methods for p in method.parameters()]

    def named_trained_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(method.state_prefix + n, p) for method in self.methods for n, p in method.named_parameters()]

    def setup_model(self) -> None:
        config = self.config
        for method in self.methods:
            method.setup()
        self.sharded = shard_parts_(self)  # after the adapters hook their base modules (sharding.py)
        if self.sharded:
            for method in self.methods:
                method.parameters_replaced()
        # a fine-tune of a sharded part: its weights, gradients and optimizer state are DTensors
        self.trains_sharded = any(is_sharded(p) for p in self.trained_parameters())
        if self.ranks.active and any(m.steps_in_backward() for m in self.methods):  # (config.py refuses it too)
            raise ConfigError(["method.fused_backward: steps each weight before the processes' gradients are "
                               "averaged; set it to false to train with several processes"])
        for part in self.trained_parts:
            self.family.parts[part].train()
        self.optimizer = build_optimizer(config.optimizer, self._param_groups(config))
        for method in self.methods:
            method.optimizer_ready(self.optimizer)
        self.ema = (EMA(self.trained_parameters(), config.ema.decay,
                        self.device if config.ema.device == "train" else torch.device("cpu"))
                    if config.ema.enabled else None)
        # float16 gradients underflow without loss scaling; for other dtypes the scaler is a no-op
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.train_dtype == "float16")
        self.resume_state = load_resume_state(self) if config.backup.resume else None

    def _param_groups(self, config: TrainConfig) -> list[dict]:
        # kohya's scale_lr: the same per-sample step size whatever the effective batch
        lr_scale = (config.schedule.batch_size * config.schedule.gradient_accumulation * self.ranks.world
                    if config.lr_scheduler.scale_by_batch_size else 1)
        groups = [group for method in self.methods for group in method.parameter_groups(config)]
        for group in groups:
            group["lr"] *= lr_scale
        return groups

    def setup_data(self) -> None:
        # each method says whether cached text stays valid while it trains (trained text encoders,
        # embeddings), the data whether captions are fixed
        cache_text = caches_text(self.config, self.family) and all(m.text_cache_allowed() for m in self.methods)
        self.text_cached = cache_text
        self.validation_set = None
        with self.ranks.main_first():  # rank 0 fills the caches, then the other ranks read them
            self.dataset = prepare_dataset(self.config, self.family, self.device, self.cache_dir,
                                           self.callbacks.on_warning, cache_text, stop=lambda: self.stopping)
            # a sharded part's forward needs every rank: then each validates (the same batches)
            if (self.ranks.main or self.sharded) and any(c.enabled and c.validation for c in self.config.concepts):
                self.validation_set = prepare_dataset(self.config, self.family, self.device, self.cache_dir,
                                                      self.callbacks.on_warning, cache_text, validation=True,
                                                      stop=lambda: self.stopping)
        self.dataset.split_among(self.ranks.rank, self.ranks.world)
        self.batches = BatchPrefetcher(self.dataset, self.config.data.prefetch_batches)
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
        # the epochs the run reaches: progress says "epoch 13/13", not "13/100", where max_steps stops it
        self.epochs_to_run = min(schedule.epochs, -(-self.total_steps // max(self.steps_per_epoch, 1)))
        if self.ranks.main and self.epochs_to_run < schedule.epochs:
            self.callbacks.on_status(f"schedule.max_steps: {schedule.max_steps} steps end the run in epoch "
                                     f"{self.epochs_to_run} of schedule.epochs {schedule.epochs} "
                                     f"({self.steps_per_epoch} steps an epoch)")
        self.scheduler = build_scheduler(self.config.lr_scheduler, self.optimizer, self.total_steps)
        if self.ranks.main and (warmup := warmup_note(self.config.lr_scheduler, self.total_steps)):
            self.callbacks.on_warning(warmup)
        self.generator = make_generator(self.device, self.config.seed)
        if self.resume_state is not None:
            restore_training_state(self, self.resume_state)
        self.steps_at_start = self.step

    # --- train -------------------------------------------------------------------------------

    @with_pinned_sdpa  # flash / memory-efficient attention while training, the process's choice after
    def train(self) -> None:
        if self.dataset is None:  # stopped while loading
            return
        config, schedule = self.config, self.config.schedule
        accumulation = schedule.gradient_accumulation
        # what the trainer steps after the backward pass: all but the weights a method steps inside it
        # (a fused backward), e.g. embeddings trained beside a fused fine-tune
        params = [p for method in self.methods if not method.steps_in_backward() for p in method.parameters()]
        compute_dtype = dtype_of(config.train_dtype)
        scaler = self.scaler
        guard = FirstStepGuard(self)  # snapshots the trained tensors before the first step
        notice = cpu_notice(self)  # before a first step that can take many minutes there
        if notice:
            self.callbacks.on_warning(notice)
        self.callbacks.on_started(self.total_steps)
        self.callbacks.on_status("training")
        started, steps_at_start = time.monotonic(), self.steps_at_start
        memory = MemoryReport(self)  # measured peaks after step 2 (memory_report.py)
        while self.step < self.total_steps and self.epoch < schedule.epochs and not self.stopping:
            batches = self.dataset.epoch_batches(self.epoch)
            if self.batch_in_epoch >= len(batches):  # resumed into a data set that has shrunk since
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                continue
            while self.batch_in_epoch < len(batches) and self.step < self.total_steps:
                group = min(accumulation, len(batches) - self.batch_in_epoch)
                loss_sum = torch.zeros((), device=self.device)
                for _ in range(group):
                    loss = self._forward(batches[self.batch_in_epoch], compute_dtype, self.batch_in_epoch)
                    scaler.scale(loss / group).backward()
                    loss_sum += loss.detach()
                    # the graph's nodes outlive the backward pass among the freed activations; kept until the
                    # next forward reassigns `loss`, they cut that memory up for it (issue 19: heap +700 MB)
                    del loss
                    self.batch_in_epoch += 1
                # several processes: gradients and loss averaged over them (distributed.py)
                self.last_loss = (self.ranks.average_gradients(params, loss_sum) if self.ranks.active
                                  else float(loss_sum)) / group
                check_finite(self.last_loss, self.step + 1)
                scale = scaler.get_scale()
                if params:  # (a fused backward's weights have no .grad left: the step skips them)
                    scaler.unscale_(self.optimizer)
                    if schedule.max_grad_norm:
                        clip = sharded_clip_grad_norm_ if self.trains_sharded else torch.nn.utils.clip_grad_norm_
                        clip(params, schedule.max_grad_norm)
                    scaler.step(self.optimizer)
                    scaler.update()
                self.scheduler.step()
                skipped = scaler.get_scale() < scale  # the scaler skipped a step with inf/nan gradients
                if not skipped:
                    guard.after_step()
                if self.ema is not None and not skipped and (self.step + 1) % self.config.ema.update_every == 0:
                    self.ema.update()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                epoch_finished = self.batch_in_epoch >= len(batches)
                if epoch_finished:
                    self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                self._report(started, steps_at_start)
                memory.after_step()
                self._on_boundary(epoch_finished)
                if self.stopping or epoch_finished:
                    break
        if note := guard.unresolved():
            self.callbacks.on_warning(note)
        if self.stopping and self.step > self.steps_at_start:
            self.callbacks.on_status("stopping: writing a backup")
            self.backup()

    def _forward(self, indices: list[int], compute_dtype: torch.dtype, batch_index: int = 0) -> torch.Tensor:
        """The loss of this process's share of the batch, weighted by the share's size (shares.py)."""
        batch = self.batches.collate(indices, self.device, self.epoch, batch_index)
        share = batch_share(indices, self.ranks.rank, self.ranks.world)
        self.family.draw_share = (share.first, len(indices)) if self.ranks.active else None
        try:
            with autocast(self.device, compute_dtype):
                out = self.family.predict(batch.latents, self.conditioning(batch), self.generator)
        finally:
            self.family.draw_share = None
        loss = training_loss(out, self.config.loss, batch.loss_weights, batch.masks)
        return loss * share.weight if self.ranks.active else loss

    def conditioning(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The batch's cached text conditioning, or a fresh encoding when a text encoder trains (or
        captions vary, or embeddings train), plus `image_info` (original size and crop, for families that condition on it)
        `control_latents` (an edit sample's control images, for the families that take them) and the
        family's pixel conditioning (ModelFamily.pixel_conditioning)."""
        text = batch.text
        if text is None:  # (a text encoder that sees the control images is shown them too)
            controls = {} if batch.text_controls is None else {"controls": batch.text_controls}
            text = self.family.encode_text(self.family.tokenize(self.captions(batch), **controls))
        if batch.image_info is not None:
            text = {**text, "image_info": batch.image_info}
        if batch.pixel_conditioning is not None:  # (an image-to-video model's first frame)
            text = {**text, **batch.pixel_conditioning}
        return {**text, "control_latents": batch.controls} if batch.controls is not None else text

    def captions(self, batch: Batch) -> list[str]:
        """The batch's captions as the methods' tokens need them (embeddings' placeholders written out)."""
        captions = batch.captions
        for method in self.methods:
            captions = method.expand_captions(captions)
        return captions

    def _report(self, started: float, steps_at_start: int) -> None:
        elapsed = time.monotonic() - started
        done = self.step - steps_at_start
        rate = done / elapsed if elapsed > 0 else 0.0
        lr = self.scheduler.get_last_lr()[0]
        self.callbacks.on_progress(Progress(
            step=self.step, total_steps=self.total_steps, epoch=self.epoch, epochs=self.epochs_to_run,
            loss=self.last_loss, lr=lr, it_per_s=rate,
            eta_s=(self.total_steps - self.step) / rate if rate > 0 else float("inf"),
        ))
        self.tensorboard.add(self.step, loss=self.last_loss, lr=lr)

    @property
    def stopping(self) -> bool:
        """A stop request; with several processes the one they agreed on at the last step (a rank
        stopping alone would leave the others waiting in a collective)."""
        return self._stop_agreed if self.ranks.active else self.commands.stop_requested

    def _on_boundary(self, epoch_finished: bool) -> None:
        requested = self.commands.take()
        table = (("validate", self.validate_action, self.validate), ("sample", self.sample_action, self.sample),
                 ("backup", self.backup_action, self.backup), ("save", self.save_action, self.save))
        wanted = [name in requested or action.due(self.step, epoch_finished, self.epoch) for name, action, _ in table]
        self._stop_agreed, wanted = self.ranks.agree(self.commands.stop_requested, wanted)
        for (_, action, run), due in zip(table, wanted):
            if due:  # (ranks other than 0 only join a backup's gather of random states)
                run()
                action.done()
        sample_requested(self, self.commands.take_prompts())  # rank 0's

    # --- actions -----------------------------------------------------------------------------

    def sample(self, prompts: list[SamplePromptConfig] | None = None, names: list[str] | None = None) -> list[Path]:
        """The config's enabled prompts (files named by their place in sampling.prompts), or `prompts`."""
        return outputs.sample(self, prompts, names)

    def validate(self) -> float | None:
        """The validation loss (validation.py), logged and reported as a `validation` event."""
        return outputs.validate(self)

    def backup(self) -> Path | None:
        return outputs.backup(self)

    @property
    def saves_sharded(self) -> bool:
        """Whether a save gathers sharded parts (every rank joins it; rank 0 writes)."""
        return bool(self.sharded) and any(m.saves_model_weights for m in self.methods)

    def save(self, path: Path | None = None) -> Path | None:
        return outputs.save(self, path)

    # --- end ---------------------------------------------------------------------------------

    def end(self) -> Path | None:
        """The final save, unless no optimizer step ran in this process: then the file at the output
        path (perhaps a good adapter of another run) is left as it was, and None is returned."""
        path = None
        # step 0: nothing trained (stopped while loading, or before step 1). A resumed run that
        # stops at once still saves: its adapter is the backup's trained one.
        if self.step > 0 and (self.ranks.main or self.saves_sharded):
            path = self.save(self.output_path)
            if self.ranks.main:
                record_output(self.workspace, self.config.output_path, path)
        elif self.step == 0:
            self.callbacks.on_warning(f"output.path: no training step ran, so nothing was saved "
                                      f"({self.output_path} is left as it was)")
        if self.tensorboard is not None:
            self.tensorboard.close()
        self.release()
        self.callbacks.on_finished()
        return path

    def release(self) -> None:
        """Free the workspace for the next run (also after an error: run_training calls it)."""
        if self.background_plan is not None:  # a plan still being made is stopped, not waited for
            self.background_plan.close()
        if self.batches is not None:
            self.batches.close()
        if self.inbox is not None:
            self.inbox.close()
        self.lock.release()
