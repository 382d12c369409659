"""The plan made beside the load (modules/trainer/background_plan.py) takes nothing of the GPU: its
child process must start no CUDA context (one takes ~500 MiB of the card the run trains on).

A tiny SD1.5 run's config is planned by the child as the trainer starts it (BackgroundPlan, on
this process's device), while this process watches the device's free memory (device-wide, so the
child's context would show as a drop; this process allocates nothing meanwhile) and the compute
processes nvidia-smi lists. Failed where the plan does not come, free memory drops by more than
DROP_LIMIT_MIB, or the child's pid is listed. Whether nvidia-smi lists this process's own pid says
whether its list can see pids here at all (a container may hide them; the free memory still
tells). The dry run: the same on the CPU, where only the plan's coming is checked.
"""

from __future__ import annotations

import json
import subprocess
import time

DROP_LIMIT_MIB = 64  # a CUDA context is hundreds of MiB; the driver's own bookkeeping moves less
POLL_S = 0.05
LIST_EVERY_S = 0.5  # nvidia-smi takes a tenth of a second or more


def compute_pids() -> set[int] | None:
    """The pids nvidia-smi lists as using the GPU, or None where it cannot say."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode:
        return None
    return {int(line) for line in done.stdout.split() if line.strip().isdigit()}


def _config_file(context) -> str:
    from modules.data.synthetic_images import write_shape_images
    from tools.gpu_check.parts.launch_events import launch_events

    model, images = context.work / "model", context.work / "images"
    code, _ = launch_events(["make-tiny-model", "--family", "sd15", "--out", str(model)])
    if code:
        raise RuntimeError(f"make-tiny-model --family sd15 exited {code}")
    write_shape_images(images, count=2, width=64, height=64)
    config = {"model": {"base": str(model), "family": "sd15"}, "concepts": [{"path": str(images)}],
              "data": {"resolution": 64}, "train_device": str(context.device),
              "workspace_dir": str(context.work / "ws"), "tensorboard": False}
    (context.work / "config.json").write_text(json.dumps(config))
    return str(context.work / "config.json")


def run(context) -> dict:
    import os

    import torch

    from modules.cli.train_command import resolve_config
    from modules.trainer.background_plan import BackgroundPlan
    from modules.trainer.fit_check import available_ram, free_device_memory

    if not context.dry and context.device.type != "cuda":
        return {"status": "skipped", "reason": "no CUDA device"}
    config = resolve_config([_config_file(context)], None, [])
    device = context.device
    cuda = device.type == "cuda"
    if cuda:
        torch.empty(1, device=device)  # this process's own context first: the baseline holds it
        torch.cuda.synchronize(device)
    free_before = free_device_memory(device)
    started = time.monotonic()
    plan = BackgroundPlan(config, device, free_before or 2**40, available_ram())
    child = plan._process.pid if plan._process is not None else None
    lowest_free, listed, lists_own, listed_at = free_before, False, None, 0.0
    try:
        while not plan._done.wait(POLL_S) and context.time_left(started) > 5:
            if cuda:
                lowest_free = min(lowest_free, free_device_memory(device))
                if time.monotonic() - listed_at >= LIST_EVERY_S:
                    listed_at = time.monotonic()
                    pids = compute_pids()
                    if pids is not None:
                        listed = listed or child in pids
                        lists_own = lists_own or os.getpid() in pids
        answer, unplanned = plan.result()
    finally:
        plan.close()
    figures = {"plan_s": round(time.monotonic() - started, 1), "unplanned": unplanned}
    if cuda:
        figures.update(child_device_drop_mib=round((free_before - lowest_free) / 2**20, 1),
                       child_pid_listed_by_nvidia_smi=listed, nvidia_smi_lists_this_process=lists_own)
    problems = []
    if unplanned:
        problems.append(f"the child's plan {unplanned}")
    if cuda and figures["child_device_drop_mib"] > DROP_LIMIT_MIB:
        problems.append(f"the device's free memory dropped {figures['child_device_drop_mib']} MiB while the child "
                        f"planned (a CUDA context of its own?)")
    if listed:
        problems.append(f"nvidia-smi lists the child (pid {child}) as a compute process")
    if problems:
        return {"status": "failed", "reason": "; ".join(problems), "figures": figures}
    return {"status": "passed", "figures": figures}
