"""`plan_run`: what a config needs on the train device and the host, per part, before anything
loads; whether that fits a budget; the smallest change that fits.

Per part (docs/memory-and-offload.md, "Planning"):
- weights: each tensor as its weight mode stores it (architecture.py builds the quantized layers
  themselves on meta), minus the parked blocks (offload_fraction: schedule.choose_parked);
- trained: the adapter's parameters (the real adapters of the config, built on fake tensors), or
  in a fine-tune the part's own weights; gradients: the trained tensors' (in a fused backward,
  the largest single weight's: each is stepped and freed as its gradient completes);
  optimizer_state: the trained parameters times what one step of the configured optimizer keeps
  per parameter (optim/state_size.py); a fine-tune's parked blocks park their state with them;
- activations: the most the training step holds beyond those (fake_pass.py), on the denoiser; the
  text encoders are in that step wherever the text cannot be cached (text_in_step);
- offload_window: the parked blocks resident at once (schedule.bytes_in_flight);
- a frozen text encoder's token table is on the host, not in its weights (offload/host_tables.py,
  the trainer's rule): host train_peak counts it.
The training step's peak is the sum. A part the step never runs (data/step_parts.py: a frozen text
encoder with the text cached, a VAE with the latents cached) holds nothing then: it is on the host
(trainer/idle_parts.py). It is on the device as placed while the caches are filled and while
samples are made, beside the step's parts' weights, adapters and optimizer state. Each of those
phases holds that and its own activations (phase_pass.py: caching, the image encoders over a cache
chunk at the largest resolution and the text encoders over its captions; sampling, the largest
prompt's denoiser forward, with the guidance batch where the pipeline batches it, and its VAE
decode): `outside_step_phases`, and `outside_step` the larger. The device peak is the larger of
the step and that. Host: during the load the final model (the streamed load) but the
quantized layers an accelerator stores as they load, during training a resting part's bytes and
the parked ones (pinned arenas on CUDA: pinned_arenas.plan_arenas), a fine-tune's with their
optimizer state. Transfers: each parked block comes over in the forward and again in the
backward (and a fine-tuned block's weights and state go home again); seconds per step from the
FLOPs and the host link of a named GPU class (gpu_classes.py), marked estimated.
Here: `plan_run` (the autos resolved in order, then the plan and its fixes) and the `Planner`, which
builds and measures; the per-part sums are part_accounting.py's, the notes plan_notes.py's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from modules.config.method_configs import METHODS
from modules.config.train_config import TrainConfig
from modules.offload.host_tables import host_table_parts, table_lookups
from modules.offload.layer_tensors import block_bytes, layer_tensors, tensor_bytes
from modules.plan.gpu_classes import gpu_class, step_seconds
from modules.plan.part_accounting import PartPlan, account_parts
from modules.plan.plan_notes import plan_notes
from modules.quantization.base import QuantizedLinear

# device types whose scaled_dot_product_attention runs a fused kernel (no L x L scores held):
# CUDA's flash / memory-efficient ones (the trainer pins them, trainer/sdpa.py) and the CPU's flash
FUSED_ATTENTION_DEVICES = ("cuda", "cpu")


@dataclass
class RunPlan:
    family: str
    budget: dict[str, int | None]
    parts: dict[str, PartPlan]
    host: dict[str, int]
    transfer: dict[str, Any]
    flops: int
    fixes: list[str] = field(default_factory=list)
    auto: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    outside_step: int = 0  # the larger phase outside the training step (caching, sampling): weights + activations
    outside_step_phases: dict[str, int] = field(default_factory=dict)  # phase -> its peak

    @property
    def step_peak(self) -> int:
        return sum(sum(p.device.values()) for p in self.parts.values())

    @property
    def device_peak(self) -> int:
        return max(self.step_peak, self.outside_step)

    @property
    def fits(self) -> bool | None:
        vram, ram = self.budget["vram"], self.budget["ram"]
        if vram is None and ram is None:
            return None
        return ((vram is None or self.device_peak <= vram)
                and (ram is None or max(self.host["load_peak"], self.host["train_peak"]) <= ram))

    def as_dict(self) -> dict:
        return {"family": self.family, "budget": dict(self.budget),
                "parts": {name: part.as_dict() for name, part in self.parts.items()},
                "device": {"peak": self.device_peak, "step": self.step_peak, "outside_step": self.outside_step,
                           "outside_step_phases": dict(self.outside_step_phases), "budget": self.budget["vram"]},
                "host": dict(self.host), "transfer": dict(self.transfer), "flops_per_step": self.flops,
                "fits": self.fits, "fixes": list(self.fixes), "auto": dict(self.auto), "notes": list(self.notes)}


def train_device_type(config: TrainConfig) -> str:
    from modules.util.torch_utils import resolve_device

    return resolve_device(config.train_device).type


def largest_resolution(config: TrainConfig) -> int:
    return max(config.data.resolutions)


def trained_kinds(config: TrainConfig, family) -> dict[str, str]:
    """part -> "adapter", "weights" or "embedding" (new token vectors in its table: the method's or a
    companion's trained embeddings) for what the step trains."""
    from modules.adapters.layer_selection import trained_parts

    traits = METHODS.traits(config.method.type)
    if traits.trains_model_weights:
        kinds = {name: "weights" for name, part in config.model.parts.items()
                 if part.train and family.spec(name).adapter_prefix}
    elif config.method.type == "embedding":
        kinds = {}
    else:
        kinds = dict.fromkeys(trained_parts(config, family), "adapter")
    for part in embedding_rows(config, family):
        kinds.setdefault(part, "embedding")
    return kinds


def embedding_rows(config: TrainConfig, family) -> dict[str, int]:
    """Text part -> the new token vectors the trained embeddings add to its table (each slot's)."""
    rows = sum(e.vectors for e in config.embeddings if e.train)
    return dict.fromkeys(family.embedding_slots, rows) if rows else {}


def text_in_step(config: TrainConfig, family) -> bool:
    """The text encoders run inside each training step: the trainer's text cache is off (a text
    encoder trains, an embedding changes what a caption encodes to, or the captions vary)."""
    from modules.data.dataset import caches_text

    return not caches_text(config, family)


def plan_run(config: TrainConfig, vram: int | None, ram: int | None, gpu_class_name: str | None = None,
             variant: str | None = None, fix: bool = True, planner: "Planner | None" = None,
             weight_ladder: list[str] | None = None) -> RunPlan:
    """The plan of `config` against `vram` bytes of train-device memory and `ram` bytes of host
    memory (None: unknown, no verdict on it). `variant`: for a released architecture (model.base
    empty), the model of a family of several (FLUX.2 "dev"). `fix`: search the smallest change
    that fits when it does not. `planner`: one that planned this model before (its fake steps are
    kept: plans of the same model for other budgets reuse them). `weight_ladder`: the modes
    `weight_dtype: auto` may take, dense first (a device's working ones; resolve_auto_weight_modes)."""
    from modules.plan.auto import (frugal_step, resolve_auto_offload, resolve_auto_step, resolve_auto_vae_tiling,
                                  resolve_auto_weight_modes)
    from modules.plan.fixes import find_fixes

    planner = planner or Planner(config, variant)
    # the weight modes first (denser storage is better weights), against the step at its smallest;
    # then checkpointing and the batch, against those modes
    in_step = planner.step_parts(config)
    frugal, weight_choices = resolve_auto_weight_modes(planner, frugal_step(config, in_step), vram, ram,
                                                       gpu_class_name, weight_ladder)
    if weight_choices:
        config = config.model_copy(update={"model": config.model.model_copy(update={"parts": {
            name: part.model_copy(update={"weight_dtype": frugal.model.parts[name].weight_dtype})
            for name, part in config.model.parts.items()}})})
    config, step_choices = resolve_auto_step(planner, config, in_step, vram, ram, gpu_class_name)
    # what is parked last, against the step as chosen: parking costs transfers, never the weights' precision
    config, offload_choices = resolve_auto_offload(planner, config, vram, ram, gpu_class_name)
    # the sample decode's tiling last: the other autos were chosen against the tiled decode
    config, tiling_choices = resolve_auto_vae_tiling(planner, config, vram, ram, gpu_class_name)
    plan = planner.plan(config, vram, ram, gpu_class_name)
    plan.auto.update(weight_choices)
    plan.auto.update(step_choices)
    plan.auto.update(offload_choices)
    plan.auto.update(tiling_choices)
    if fix and plan.fits is False:
        plan.fixes = find_fixes(planner, config, vram, ram, gpu_class_name)
    return plan


def _tensors_outside_blocks(module, blocks, left_out=()) -> list[int]:
    """The bytes of each tensor of `module` that none of its blocks (nor the modules `left_out`) holds
    (a tied one once)."""
    in_blocks = {id(t.get()) for block in [*blocks, *left_out] for t in layer_tensors(block)}
    unique = {id(t.get()): t.get() for t in layer_tensors(module) if id(t.get()) not in in_blocks}
    return [tensor_bytes(tensor) for tensor in unique.values()]


class Planner:
    """Plans of one model and its variations (the fixes' search re-plans through it): the meta
    architecture is built once per set of weight modes (the phase passes get a copy of it kept from
    before the step changed it), the fake step once per set of what shapes it (checkpointing, batch,
    resolution, what trains)."""

    def __init__(self, config: TrainConfig, variant: str | None = None):
        self.variant = variant
        self._steps: dict[tuple, Any] = {}
        self._sizes: dict[tuple, dict] = {}
        self._unused = None
        self._pristine = None
        self._controls: dict[str, Any] = {}

    def controls(self, config: TrainConfig):
        """The control images per sample the step is planned with (controls.py), read once per concepts."""
        from modules.config.families import get_family_class
        from modules.plan.controls import planned_controls

        key = config.model.family + "".join(c.model_dump_json() for c in config.concepts)
        if key not in self._controls:
            self._controls[key] = planned_controls(config, get_family_class(config.model.family))
        return self._controls[key]

    def step_parts(self, config: TrainConfig) -> set[str]:
        """The parts the training step runs: the denoiser, what trains, the text encoders where the text is not cached."""
        import torch

        family = self.sizes(config, self.weight_modes(config))["family"]
        side = largest_resolution(config)  # as the fake pass asks
        counted = text_in_step(config, family) and family.planning_tokens_with_controls(
            1, torch.device("meta"), self.controls(config).count, side, side) is not None
        text = family.text_parts if counted else ()
        return {family.denoiser_part, *trained_kinds(config, family), *text}

    def weight_modes(self, config: TrainConfig) -> dict[str, str]:
        from modules.plan.auto import planned_weight_modes

        return planned_weight_modes(config)

    def _architecture(self, config: TrainConfig, modes: dict[str, str]):
        from modules.plan.architecture import build_architecture

        return build_architecture(config, modes, self.variant)

    def sizes(self, config: TrainConfig, modes: dict[str, str]) -> dict:
        """Per part: its tensors' bytes, its blocks' bytes, its floating parameters (count, largest)."""
        # (train_dtype too: the layers a quantized mode leaves dense are stored in it)
        key = (tuple(sorted(modes.items())), tuple(sorted((n, tuple(p.quantize_skip)) for n, p in
                                                           config.model.parts.items())), config.train_dtype)
        if key not in self._sizes:
            planned = self._architecture(config, modes)
            family = planned.family
            sizes = {}
            for name, module in family.parts.items():
                floating = [p for p in module.parameters() if p.is_floating_point()]
                table = table_lookups(module, family.never_run.get(name, ())) if name in family.text_parts else []
                sizes[name] = {
                    "bytes": block_bytes(module),
                    "blocks": [block_bytes(b) for b in family.checkpoint_blocks(name)],
                    "block_tensors": [[tensor_bytes(t.get()) for t in layer_tensors(b)]
                                      for b in family.checkpoint_blocks(name)],
                    "other_tensors": _tensors_outside_blocks(module, family.checkpoint_blocks(name)),
                    # its token table, which waits on the host where the encoder is frozen (host_tables.py)
                    "table": sum(_tensors_outside_blocks(module, [])) - sum(_tensors_outside_blocks(module, [], table)),
                    "tensors_beside_table": _tensors_outside_blocks(module, family.checkpoint_blocks(name), table),
                    "quantized_bytes": sum(block_bytes(m) for m in module.modules() if isinstance(m, QuantizedLinear)),
                    "parameters": sum(p.numel() for p in floating),
                    "parameter_bytes": sum(p.numel() * p.element_size() for p in floating),
                    "largest_parameter_bytes": max((p.numel() * p.element_size() for p in floating), default=0),
                }
            self._sizes[key] = {"parts": sizes, "family": family, "config": planned.config,
                                "released": planned.released}
            self._unused = (tuple(sorted(modes.items())), planned)  # the first step may use (and change) this one
        return self._sizes[key]

    def step(self, config: TrainConfig, modes: dict[str, str], trained: dict[str, str]):
        from modules.adapters.adapter_set import build_adapter_set
        from modules.plan.fake_pass import measure_step

        parts = config.model.parts
        # (the weight modes change what the step holds beyond the weights through the dtypes the parts
        # compute in, not otherwise: the key has those, so the searches re-plan 8-bit for a bfloat16
        # part computing in bfloat16 without another pass)
        from modules.quantization.weight_modes import DENSE_DTYPES

        computes = tuple(sorted((n, DENSE_DTYPES.get(m) and m or config.train_dtype) for n, m in modes.items()))
        controls = self.controls(config).count
        key = (computes, controls, tuple(sorted(trained.items())), config.schedule.batch_size, train_device_type(config),
               largest_resolution(config), tuple(c.video.frames for c in config.concepts if c.enabled),
               tuple(sorted((n, p.gradient_checkpointing is True, p.activation_offloading) for n, p in parts.items())),
               config.adapter.model_dump_json() if hasattr(config, "adapter") else None,
               text_in_step(config, self.sizes(config, modes)["family"]),
               tuple(sorted(embedding_rows(config, self.sizes(config, modes)["family"]).items())))
        if key not in self._steps:
            unused, self._unused = self._unused, None
            # the pass changes its parts (hooks, emptied tensors): the sizes' architecture, once, else a fresh one
            if unused and unused[0] == tuple(sorted(modes.items())):
                planned = unused[1]
                # a copy kept unchanged for the phase passes, which also change what they run: copying
                # the meta parts costs a fraction of building them again (Qwen-Image-Edit 0.24 s of 0.84 s)
                self._pristine = (unused[0], copy.deepcopy(planned))
            else:
                planned = self._architecture(config, modes)
            family = planned.family
            adapters = []

            def build(adapter_parts, device):
                built = build_adapter_set(family, config.adapter, adapter_parts, device, config.output.format)
                adapters.append(built)
                return built

            figures = measure_step(family, config, trained, config.schedule.batch_size, largest_resolution(config),
                                   {n: p.gradient_checkpointing is True for n, p in parts.items()},
                                   {n: p.activation_offloading for n, p in parts.items()}, build,
                                   fused_attention=train_device_type(config) in FUSED_ATTENTION_DEVICES,
                                   controls=controls, text_in_step=text_in_step(config, family),
                                   embedding_rows=embedding_rows(config, family))
            adapter_bytes: dict[str, int] = {}
            adapter_params: dict[str, int] = {}
            for built in adapters:
                for part in set(built.part_of.values()):
                    params = built.parameters(part)
                    adapter_params[part] = sum(p.numel() for p in params)
                    adapter_bytes[part] = sum(p.numel() * p.element_size() for p in params)
            if figures.text_counted:  # the new vectors (float32, as the embedding method makes them)
                from modules.model.components.embedding_tokens import token_embedding

                for part, rows in embedding_rows(config, family).items():
                    count = rows * token_embedding(family.parts[part]).embedding_dim
                    adapter_params[part] = adapter_params.get(part, 0) + count
                    adapter_bytes[part] = adapter_bytes.get(part, 0) + 4 * count
            self._steps[key] = (figures, adapter_params, adapter_bytes)
        return self._steps[key]

    def phases(self, config: TrainConfig, modes: dict[str, str]):
        """The activation peaks of caching and sampling (phase_pass.py), once per what shapes them."""
        from modules.plan.fake_pass import planned_frames
        from modules.plan.phase_pass import PhasePasses, planned_tiling

        family = self.sizes(config, modes)["family"]
        from modules.quantization.weight_modes import DENSE_DTYPES

        # (as the step's key: the weight modes shape the activations through the dtypes the parts compute in)
        computes = tuple(sorted((n, DENSE_DTYPES.get(m) and m or config.train_dtype) for n, m in modes.items()))
        cache_text = not text_in_step(config, family)
        key = ("phases", computes, largest_resolution(config), planned_frames(config, family),
               config.data.flip, config.data.cache_latents, cache_text, train_device_type(config),
               tuple(p.model_dump_json() for p in config.sampling.prompts if p.enabled))
        # (the sample decode's tiling is not in the key: one config's plans tiled and whole share the
        # passes it does not change, PhasePasses)
        if key not in self._steps:
            # (a fresh one: the passes place its tensors)
            pristine, self._pristine = self._pristine, None
            planned = pristine[1] if pristine and pristine[0] == tuple(sorted(modes.items())) else \
                self._architecture(config, modes)
            self._steps[key] = PhasePasses(
                planned.family, config, largest_resolution(config), planned_frames(config, planned.family),
                config.data.cache_latents, cache_text, train_device_type(config) in FUSED_ATTENTION_DEVICES)
        return self._steps[key].figures(planned_tiling(config))

    def plan(self, config: TrainConfig, vram: int | None, ram: int | None, gpu_class_name: str | None) -> RunPlan:
        from modules.data.step_parts import idle_parts

        modes = self.weight_modes(config)
        sized = self.sizes(config, modes)
        family = sized["family"]
        trained = trained_kinds(config, family)
        step = self.step(config, modes, trained)
        figures = step[0]
        in_step = text_in_step(config, family)
        # caching runs them, the step never does: as placed while caching and sampling, else on the host
        idle = set(idle_parts(config, family, trained, not in_step))
        tables = set(host_table_parts(config, family, trained))  # looked up on the host, never on the device
        accounts = account_parts(config, sized, modes, trained, step, idle, tables, vram, train_device_type(config))
        gpu = gpu_class(gpu_class_name)
        transfer_info = {"bytes_per_step": int(accounts.transfer),
                         "seconds_per_step": step_seconds(figures.flops, accounts.transfer, gpu),
                         "gpu_class": gpu.name, "estimated": True}
        # caching and sampling: every part as placed (the weights and windows summed), with the
        # adapters and optimizer state, and the phase's own activations (phase_pass.py)
        phased = self.phases(config, modes)
        phases = {name: accounts.placed + peak for name, peak in (("caching", phased.caching),
                                                                  ("sampling", phased.sampling)) if peak is not None}
        largest = max(phases.values(), default=accounts.placed if idle else 0)
        plan = RunPlan(config.model.family, {"vram": vram, "ram": ram}, accounts.parts, accounts.host, transfer_info,
                       figures.flops, outside_step=largest, outside_step_phases=phases)
        plan.notes = plan_notes(config, family, sized, accounts, phases, phased.notes, idle, largest_resolution(config),
                                figures.text_counted, self.controls(config), in_step)
        return plan
