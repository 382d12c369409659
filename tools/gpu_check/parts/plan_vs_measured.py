"""The plan's training-step peak against the trainer's measured one (issue 25: within 10% on
real-width SDXL and FLUX.1 slices).

Per family, a tiny model folder (`launch.py make-tiny-model`) made real-width
(real_width_folder.py: the SDXL UNet with 4 of its 10 third-level layers, FLUX.1 with 2 double and
4 single blocks at 3072 wide, the released VAEs), bf16, gradient checkpointing, a LoRA, batch 1,
1024 px, 3 steps, at offload_fraction 0 and 0.5. Each is trained the way a user does
(`launch.py train --protocol jsonl`), and the same config file is planned here with
modules/plan/run_plan.plan_run (not through preflight, which skips planning on a device that
surely fits). The trainer's `memory` event (after step 2) gives the measured peak: the train
device's max_memory_allocated since training began; the plan's is `device.step`, the training
step's. A case fails where measured / planned is off by more than 10%.

The dry run: SDXL's layout at tiny widths, 64 px, on the CPU, where the measure is the host's peak
resident memory over the start of the load (process-wide, so the earlier parts' too): it checks the
plumbing (the events read, the plan made, the ratio computed), not the 10%.
"""

from __future__ import annotations

import json
import time
from functools import partial

TOLERANCE = 0.10
STEPS = 3
DENOISER = {"sdxl": "unet", "flux": "transformer"}
CASE_SECONDS = 15  # below this much of the part's budget left, a case is not started


def _config(family: str, model, images, fraction: float, work, context) -> dict:
    dtype = "float32" if context.dry else "bfloat16"
    parts = {name: {"weight_dtype": dtype} for name in ("text_encoder", "text_encoder_2", "vae")}
    parts[DENOISER[family]] = {"weight_dtype": dtype, "gradient_checkpointing": True, "offload_fraction": fraction}
    return {"model": {"base": str(model), "family": family, "parts": parts},
            "concepts": [{"path": str(images)}], "data": {"resolution": 64 if context.dry else 1024},
            "adapter": {"type": "lora", "rank": 16}, "schedule": {"max_steps": STEPS, "batch_size": 1},
            "sampling": {"prompts": []}, "train_dtype": dtype, "train_device": "cpu" if context.dry else "auto",
            "workspace_dir": str(work / "ws"), "cache_dir": str(work.parent / "cache"),
            "output": {"path": str(work / "out.safetensors")}, "tensorboard": False}


def measured_peak(measured: dict) -> tuple[int | None, str]:
    """(bytes, what they are) from a `memory` event's `measured`: the device's peak allocated, or
    on the CPU the host's peak resident memory over the start of the load."""
    if measured.get("device_peak_allocated") is not None:
        return measured["device_peak_allocated"], "device peak allocated"
    peak, before = measured.get("host_peak_rss"), measured.get("host_rss_before_load")
    if peak is None or before is None:
        return None, "nothing measured"
    return peak - before, "host peak RSS over the load's start"


def run_case(family: str, model, images, fraction: float, planners: dict, context) -> dict:
    """One training of `family` at `fraction`, planned first; `planners`: one per family, so the
    second fraction reuses the first's fake step."""
    import torch

    from modules.cli.train_command import resolve_config
    from modules.plan.run_plan import Planner, plan_run
    from tools.gpu_check.parts.launch_events import launch_events, launch_problem

    work = context.work / family / f"offload-{fraction}"
    work.mkdir(parents=True, exist_ok=True)
    config_file = work / "config.json"
    config_file.write_text(json.dumps(_config(family, model, images, fraction, work, context)))
    started = time.monotonic()
    # the config as `train` reads it, planned as `plan` does it, with no budget (no verdict, no fixes)
    config = resolve_config([str(config_file)], None, [])
    planner = planners.setdefault(family, Planner(config))
    plan = plan_run(config, None, None, planner=planner).as_dict()
    plan_s = time.monotonic() - started
    # what this process still holds on the device counts in the run's peak: said beside it
    allocated_before = torch.cuda.memory_allocated() if context.device.type == "cuda" else None
    started = time.monotonic()
    code, events = launch_events(["train", "--config", str(config_file), "--protocol", "jsonl"])
    problem = launch_problem(code, events, ["memory", "finished"])
    if problem:
        return {"status": "failed", "reason": f"train: {problem}"}
    memory = next(event for event in events if event.get("event") == "memory")
    measured, measure = measured_peak(memory.get("measured") or {})
    planned = plan["device"]["step"]
    if measured is None or not planned:
        return {"status": "failed", "reason": f"no figure to compare: measured {measured}, planned {planned}"}
    denoiser = plan["parts"][DENOISER[family]]
    reserved = memory["measured"].get("device_peak_reserved")
    figures = {"planned_gib": _gib(planned), "measured_gib": _gib(measured), "ratio": round(measured / planned, 3),
               "measure": measure, **({"reserved_gib": _gib(reserved)} if reserved is not None else {}),
               **({"allocated_before_gib": _gib(allocated_before)} if allocated_before is not None else {}),
               "parked_blocks": f"{denoiser['parked_blocks']} of {denoiser['blocks']}",
               "plan_s": round(plan_s, 1), "train_s": round(time.monotonic() - started, 1),
               # the run's own plan (made beside the load where the device surely fits), or why none
               "event_planned_gib": _gib(memory["planned"]["device_peak"]) if memory.get("planned") else None,
               "event_unplanned": memory.get("unplanned")}
    return {**verdict(planned, measured, context.dry), "figures": figures}


def verdict(planned: int, measured: int, dry: bool) -> dict:
    """passed within TOLERANCE of the plan (the dry run's CPU measure is not held to it: passed)."""
    ratio = measured / planned
    if dry or abs(ratio - 1) <= TOLERANCE:
        return {"status": "passed"}
    return {"status": "failed", "reason": f"measured {_gib(measured)} GiB is {ratio:.2f}x the planned "
                                          f"{_gib(planned)} GiB (more than {TOLERANCE:.0%} off)"}


def _gib(size: int) -> float:
    return round(size / 2**30, 4)


def prepare_family(family: str, context):
    """(the real-width model folder, its images) of `family`."""
    import torch

    from modules.data.synthetic_images import write_shape_images
    from tools.gpu_check.parts.launch_events import launch_events
    from tools.gpu_check.parts.real_width_folder import MAKERS

    model = context.work / family / "model"
    code, _ = launch_events(["make-tiny-model", "--family", family, "--out", str(model)])
    if code:
        raise RuntimeError(f"make-tiny-model --family {family} exited {code}")
    MAKERS[family](model, context.device, torch.float32 if context.dry else torch.bfloat16, context.dry)
    side = 64 if context.dry else 1024
    images = context.work / family / "images"
    write_shape_images(images, count=2, width=side, height=side)
    return model, images


def run(context) -> dict:
    import os

    from tools.gpu_check.part import NO_TIME, failed_case, record_case, summary

    if not context.dry and context.device.type != "cuda":
        return {"status": "skipped", "reason": "no CUDA device"}
    os.environ["DIFFTRAINER_HOME"] = str(context.work / "home")  # no user preset or setting comes in
    started = time.monotonic()
    cases, planners = [], {}
    for family in ["sdxl"] if context.dry else ["sdxl", "flux"]:
        names = [f"{family} offload {fraction}" for fraction in (0.0, 0.5)]
        if context.time_left(started) < 2 * CASE_SECONDS:
            cases += [{"name": name, "status": "skipped", "reason": NO_TIME} for name in names]
            continue
        try:
            model, images = prepare_family(family, context)
        except Exception as error:  # noqa: BLE001  (one family's failure is its cases')
            cases += [{"name": name, **failed_case(error)} for name in names]
            continue
        for name, fraction in zip(names, (0.0, 0.5)):
            record_case(context, cases, name, partial(run_case, family, model, images, fraction, planners, context),
                        started, CASE_SECONDS)
    return {**summary(cases), "cases": cases}
