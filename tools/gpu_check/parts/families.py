"""One tiny end-to-end run per family through the CLI (launch.py's own `make-tiny-model` and
`train --protocol jsonl`, called in this process to spare the imports): the family's first
built-in LoRA preset on its tiny model, 2 steps that sample, back up and save, then `--resume` for a
third step. The dry run: SD1.5 alone, on the CPU."""

from __future__ import annotations

import json
import os
import time
from functools import partial

CASE_SECONDS = 20  # below this much of the part's budget left, a family is not started
SETTINGS = {"data": {"resolution": 64}, "schedule": {"max_steps": 2, "sample_every": 2, "backup_every": 2},
            "tensorboard": False}


def run_family(family: str, context) -> dict:
    from modules.config.presets import list_presets
    from modules.data.synthetic_images import write_shape_images
    from modules.config.families import get_family_class
    from tools.gpu_check.parts.launch_events import launch_events, launch_problem

    builtin = [p for p in list_presets() if p.builtin and p.family == family]
    preset = next((p for p in builtin if "LoRA" in p.name), builtin[0] if builtin else None)
    work = context.work / family
    images = work / "images"
    write_shape_images(images, count=4, width=64, height=64)
    argv = ["make-tiny-model", "--family", family, "--out", str(work / "model")]
    options = get_family_class(family).tiny_model_options(preset.name) if preset else {}
    if options.get("variant"):
        argv += ["--variant", options["variant"]]
    started = time.monotonic()
    code, _ = launch_events(argv)
    if code:
        return {"status": "failed", "reason": f"make-tiny-model exited {code}"}
    prompts = [{"prompt": "a red square", "steps": 2, "width": 64, "height": 64}]
    config = {**SETTINGS, "model": {"base": str(work / "model"), "family": family},
              "concepts": [{"path": str(images)}], "sampling": {"prompts": prompts},
              "train_device": "cpu" if context.dry else "auto", "workspace_dir": str(work / "ws"),
              "output": {"path": str(work / "out" / "adapter.safetensors")}}
    (work / "config.json").write_text(json.dumps(config))
    # an image-to-video family samples from its first (and last) frame: the prompt gets them
    prompts[0]["control_images"] = [str(path) for path in sorted(images.glob("*.png"))][:prompt_images(family, work)]
    (work / "config.json").write_text(json.dumps(config))
    train = ["train", "--config", str(work / "config.json"), "--protocol", "jsonl"] + (
        ["--preset", preset.name] if preset else [])
    code, events = launch_events(train)
    problem = launch_problem(code, events, ["sample", "backup", "saved", "finished"])
    if problem:
        return {"status": "failed", "reason": f"train: {problem}"}
    trained_s = time.monotonic() - started
    code, resumed = launch_events(train + ["--resume", "--set", "schedule.max_steps=3"])
    problem = launch_problem(code, resumed, ["progress", "saved", "finished"])
    steps = [event["step"] for event in resumed if event.get("event") == "progress"]
    if not problem and steps != [3]:
        problem = f"resumed at the wrong step: progress steps {steps}, expected [3]"
    if problem:
        return {"status": "failed", "reason": f"resume: {problem}"}
    return {"status": "passed", "figures": {"preset": preset.name if preset else None, "train_s": round(trained_s, 1),
                                            "total_s": round(time.monotonic() - started, 1)}}


def prompt_images(family: str, work) -> int:
    """How many images each sample prompt must hold with the model in `work` (its config.json): the
    model's exact count where its files tell it (Wan 2.1 I2V: one, or two with an FLF2V
    transformer), else the fewest its family samples from."""
    from modules.cli.train_command import resolve_config
    from modules.config.families import get_family_class

    model = get_family_class(family)(resolve_config([str(work / "config.json")], None, []))
    exact = model.exact_prompt_images()
    return exact.count if exact is not None else model.prompt_images[0]


def run(context) -> dict:
    from modules.config.families import family_names
    from tools.gpu_check.part import record_case, summary

    os.environ["DIFFTRAINER_HOME"] = str(context.work / "home")  # no user preset shadows a built-in one
    started = time.monotonic()
    cases = []
    for family in ["sd15"] if context.dry else family_names():
        record_case(context, cases, family, partial(run_family, family, context), started, CASE_SECONDS)
    return {**summary(cases), "cases": cases}
