"""The per-part sums of a plan (run_plan.Planner.plan): for each part what the training step holds
on the train device (weights as stored less the parked blocks, trained tensors, gradients,
optimizer state, the step's activations on the denoiser, the parked blocks resident at once), and
what the host holds at the load and while training (a resting part, the parked blocks in pinned
arenas, a fine-tune's parked state, the idle parts' home copies, the token tables looked up there),
and the bytes the parked blocks move over the host link each step. docs/memory-and-offload.md,
"Planning", says why each figure is what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from modules.config.train_config import TrainConfig
from modules.offload.schedule import bytes_in_flight, choose_parked

DEVICE_KEYS = ("weights", "trained", "gradients", "optimizer_state", "activations", "offload_window")


@dataclass
class PartPlan:
    weight_dtype: str
    offload_fraction: float
    gradient_checkpointing: bool
    train: bool
    device: dict[str, int]
    parked: int
    blocks: int = 0
    parked_blocks: int = 0

    def as_dict(self) -> dict:
        return {"weight_dtype": self.weight_dtype, "offload_fraction": self.offload_fraction,
                "gradient_checkpointing": self.gradient_checkpointing, "train": self.train,
                "device": {**self.device, "total": sum(self.device.values())}, "parked": self.parked,
                "blocks": self.blocks, "parked_blocks": self.parked_blocks}


@dataclass
class PartAccounts:
    parts: dict[str, PartPlan]
    host: dict[str, int]  # load_peak, train_peak, pinned
    transfer: float  # bytes over the host link per step (a float: a fine-tune's window factor scales them)
    placed: int  # every part as placed (weights, trained, optimizer state, windows): what caching and sampling hold
    table_parts: list[str]  # the parts whose token tables are on the host
    table_total: int


def host_bytes_at_load(device_type: str, size: dict, fraction: float) -> int:
    """What of a part the streamed load puts in host memory: all of it, but for an accelerator train
    device the quantized layers of a part that parks nothing, which are quantized and stored on the
    device as they load (the trainer's weight_modes.quantize_device, part_loading.quantized_home)."""
    on_device = device_type not in ("cpu", "meta") and fraction == 0
    return size["bytes"] - (size["quantized_bytes"] if on_device else 0)


def account_parts(config: TrainConfig, sized: dict, modes: dict[str, str], trained: dict[str, str], step,
                  idle: set[str], tables: set[str], vram: int | None, device_type: str) -> PartAccounts:
    """The sums over `sized["parts"]` (Planner.sizes) for the step `step` (Planner.step: its figures,
    the trained tensors' parameters and bytes per part). `idle`: the parts the step never runs (on
    the host while training); `tables`: the parts whose token table is looked up on the host."""
    from modules.offload.pinned_arenas import plan_arenas
    from modules.optim.state_size import optimizer_state_bytes_per_parameter
    from modules.plan.auto import offload_fractions

    figures, adapter_params, adapter_bytes = step
    family = sized["family"]
    state_per_parameter = optimizer_state_bytes_per_parameter(config) if trained else 0.0
    fused = bool(getattr(config.method, "fused_backward", False))
    resting = set(family.resting_parts())  # only sampling runs them: on the host while training
    table_total, table_parts = 0, []
    outside_step, idle_resident_tensors = 0, []
    fractions = offload_fractions(config, sized["parts"], trained, state_per_parameter, vram, tuple(resting),
                                  tuple(tables))
    parts, parked_total, transfer, host_parked_tensors, loaded_on_host, parked_state = {}, 0, 0, [], 0, 0
    for name, size in sized["parts"].items():
        part_config = config.model.parts[name]
        kind = trained.get(name)
        fraction = 1.0 if name in resting else fractions[name]
        loaded_on_host += host_bytes_at_load(device_type, size, fractions[name])
        blocks = size["blocks"]
        window = 1 + part_config.offload_prefetch
        parked = choose_parked(blocks, fraction, window) if fraction > 0 and blocks else []
        parked_bytes = sum(blocks[i] for i in parked)
        in_flight = bytes_in_flight(blocks, parked, window) if parked else 0
        device = dict.fromkeys(DEVICE_KEYS, 0)
        table = size["table"] if name in tables else 0
        table_total += table
        table_parts += [name] if table else []
        resident = size["bytes"] - parked_bytes - table
        if name in resting:  # nothing of it on the train device during training
            parked_bytes, in_flight, resident = size["bytes"], 0, 0
            parked = list(range(len(blocks)))
        if kind == "weights":
            # the fine-tuned weights are what trains; their state parks with their block
            trained_share = size["parameter_bytes"] / size["bytes"] if size["bytes"] else 0.0
            device["trained"] = int(resident * trained_share)
            device["weights"] = resident - device["trained"]
            state = state_per_parameter * size["parameters"]
            state_share = (size["bytes"] - parked_bytes) / size["bytes"] if size["bytes"] else 1.0
            device["optimizer_state"] = int(state * state_share)
            device["gradients"] = size["largest_parameter_bytes"] if fused else size["parameter_bytes"]
            window_factor = 1.0 + (state / size["bytes"] if size["bytes"] else 0.0)
            # the parked blocks' state waits on the host with them (offload/trained_tensors.py)
            parked_state += int(state * (parked_bytes / size["bytes"] if size["bytes"] else 0.0))
            device["offload_window"] = int(in_flight * window_factor)
            transfer += 2 * parked_bytes * window_factor  # in for the forward; in and home for the backward
        else:
            device["weights"] = resident
            device["offload_window"] = in_flight
            if kind in ("adapter", "embedding"):
                device["trained"] = adapter_bytes.get(name, 0)
                device["gradients"] = adapter_bytes.get(name, 0)
                device["optimizer_state"] = int(state_per_parameter * adapter_params.get(name, 0))
            # a part the step runs brings its parked blocks over in the forward and again for the
            # backward; a text encoder in the step that nothing flows back through, in the forward only
            # (with the text cache a frozen encoder is not in the step: the cache stands in for it)
            if name in {family.denoiser_part, *trained}:
                transfer += 2 * parked_bytes
            elif figures.text_counted and name in family.text_parts:
                transfer += parked_bytes
        if name == family.denoiser_part:
            device["activations"] = figures.activations
        outside_step += sum(device[k] for k in ("weights", "trained", "optimizer_state", "offload_window"))
        if name in idle:  # its resident tensors wait on the host in pinned home copies (its host table is home)
            idle_resident_tensors += (size["tensors_beside_table"] if table else size["other_tensors"]) + [
                t for i, tensors in enumerate(size["block_tensors"]) if i not in set(parked) for t in tensors]
            device = dict.fromkeys(DEVICE_KEYS, 0)
        parked_total += parked_bytes
        if parked and name not in resting:  # (a resting part is pinned only while samples are made)
            host_parked_tensors += [t for i in parked for t in size["block_tensors"][i]]
        parts[name] = PartPlan(modes[name], fraction, part_config.gradient_checkpointing is True,
                               bool(part_config.train), device, parked_bytes, len(blocks), len(parked))
    pinned = plan_arenas(host_parked_tensors).pinned_bytes if host_parked_tensors else 0
    idle_pinned = plan_arenas(idle_resident_tensors).pinned_bytes if idle_resident_tensors else 0
    resting_bytes = sum(sized["parts"][name]["bytes"] for name in resting if name in sized["parts"])
    # a resting part waits on the host as it is; the parked blocks in pinned arenas where the device
    # pins, a fine-tune's with their optimizer state
    host = {"load_peak": loaded_on_host,
            "train_peak": (resting_bytes + max(parked_total - resting_bytes, pinned) + parked_state + idle_pinned
                           + table_total),
            "pinned": pinned + idle_pinned}
    return PartAccounts(parts, host, transfer, outside_step, table_parts, table_total)
