"""The run's measured memory, reported once, after its second optimizer step (the `memory` event).

By step 2 every buffer a step needs exists: the optimizer's state (created by the first step),
the gradients, the offload window's working set and the activations of a whole forward and
backward pass. The train device's peaks come from its torch device module, found by the device's
type (`torch.cuda`, or the tests' `torch.fakegpu`): `max_memory_allocated`, and
`max_memory_reserved` where the module has it (CUDA's caching allocator; the fake device has
none). Those peaks are reset when training starts, so they are the training's, not the load's
(loading quantizes on the device and frees as it goes). The host's figure is the process's peak
resident memory (VmHWM, load included), its resident memory now, and what it was as the model
load began (`host_rss_before_load`: the interpreter, torch and the libraries; the plan's host
figures are growth over it, so peak minus it is what to read beside them). On the CPU there is no
device figure: the host's is the whole story (and holds the "device" memory too). Where the run
was planned before loading (preflight's fit check, or an `auto` resolved through the plan), or
beside the load where the device surely fits (background_plan.py), the planned peaks go beside the
measured ones; a plan made beside the run that is not ready or failed is said in `unplanned`.

Torch-free at import: the GUI and the console format the event with `describe_memory`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modules.util.memory import process_memory

if TYPE_CHECKING:
    import torch

REPORT_AFTER_STEPS = 2  # this process's optimizer steps before the report
# a plan made beside the run (background_plan.py) not ready by then is waited for this long at most:
# it takes seconds, a real model's load and caching longer, so this is the rare case; short, because
# the training thread waits (a tiny model's run, as the GPU check makes a dozen of, reaches step 2
# before the child has imported torch: it says "not ready" rather than holding each run 10 s)
REPORT_PLAN_WAIT_S = 1.0


def device_module(device: torch.device):
    """The torch module of the device's type with peak counters (torch.cuda, torch.xpu, ...), or
    None for the CPU and for devices that count nothing."""
    import torch

    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    return module if callable(getattr(module, "max_memory_allocated", None)) else None


def reset_device_peaks(device: torch.device) -> None:
    module = device_module(device)
    if module is not None and callable(getattr(module, "reset_peak_memory_stats", None)):
        module.reset_peak_memory_stats(device)


def measured_memory(device: torch.device, rss_before_load: int | None = None) -> dict:
    """{"device": name, "device_peak_allocated", "device_peak_reserved", "host_peak_rss",
    "host_rss", "host_rss_before_load"}: bytes, None where this machine cannot say."""
    module = device_module(device)
    allocated = reserved = None
    if module is not None:
        allocated = int(module.max_memory_allocated(device))
        if callable(getattr(module, "max_memory_reserved", None)):
            reserved = int(module.max_memory_reserved(device))
    host = process_memory()
    return {"device": str(device), "device_peak_allocated": allocated, "device_peak_reserved": reserved,
            "host_peak_rss": host.get("peak_rss"), "host_rss": host.get("rss"), "host_rss_before_load": rss_before_load}


class MemoryReport:
    """Created when training starts (resets the device's peaks); `after_step` reports once."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.first_step = trainer.step  # a resumed run counts from its backup's step
        self.reported = False
        reset_device_peaks(trainer.device)

    def due(self) -> bool:
        trainer = self.trainer
        done = trainer.step - self.first_step
        # a run shorter than two steps reports after its last one
        return not self.reported and (done >= REPORT_AFTER_STEPS or (done > 0 and trainer.step >= trainer.total_steps))

    def after_step(self) -> None:
        if not self.due() or not self.trainer.ranks.main:
            return
        self.reported = True
        report = {"step": self.trainer.step,
                  "measured": measured_memory(self.trainer.device, getattr(self.trainer, "rss_before_load", None))}
        plan = getattr(self.trainer, "plan", None)
        background = getattr(self.trainer, "background_plan", None)
        if not plan and background is not None:  # the plan made while loading (background_plan.py)
            plan, unplanned = background.result(REPORT_PLAN_WAIT_S)
            background.close()  # read once: a plan still being made is of no more use
            if unplanned:
                report["unplanned"] = f"the plan made beside the run {unplanned}"
                if unplanned.startswith("failed"):
                    self.trainer.callbacks.on_warning(f"memory: {report['unplanned']}; the run goes on without it")
        if plan:  # beside what the plan said before loading (modules/plan/), where one was made
            # (the training step's: the peaks were reset as training began, after the caches were filled)
            report["planned"] = {"device_peak": plan["device"].get("step", plan["device"]["peak"]), "host_train_peak": plan["host"]["train_peak"],
                                 "host_load_peak": plan["host"]["load_peak"]}
        self.trainer.callbacks.on_memory(report)


def describe_memory(report: dict) -> str:
    """One line: "memory after step 2: fakegpu peak 1.20 GiB allocated (planned 1.10 GiB); host
    peak 3.40 GiB resident, 2.10 GiB over the start of the load (planned 2.00 GiB loading, ...)"."""
    measured, planned = report.get("measured") or {}, report.get("planned") or {}
    parts = []
    if measured.get("device_peak_allocated") is not None:
        text = f"{measured.get('device')} peak {_gib(measured['device_peak_allocated'])} allocated"
        if measured.get("device_peak_reserved") is not None:
            text += f", {_gib(measured['device_peak_reserved'])} reserved"
        if planned.get("device_peak") is not None:
            text += f" (planned {_gib(planned['device_peak'])})"
        parts.append(text)
    if measured.get("host_peak_rss") is not None:
        text = f"host peak {_gib(measured['host_peak_rss'])} resident"
        if measured.get("host_rss_before_load") is not None:
            text += f", {_gib(measured['host_peak_rss'] - measured['host_rss_before_load'])} over the start of the load"
        if planned.get("host_train_peak") is not None:
            text += f" (planned {_gib(planned['host_train_peak'])} training"
            if planned.get("host_load_peak") is not None:
                text += f", {_gib(planned['host_load_peak'])} loading"
            text += ")"
        parts.append(text)
    if report.get("unplanned"):
        parts.append(f"no plan: {report['unplanned']}")
    return f"memory after step {report.get('step')}: " + ("; ".join(parts) or "not measurable here")


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
