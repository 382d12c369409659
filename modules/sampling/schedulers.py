"""Sampling schedulers by config name, built from the model's own noise-schedule config."""

from __future__ import annotations

from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
)

_SCHEDULERS = {
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "euler_a": EulerAncestralDiscreteScheduler,
    "dpmpp_2m": DPMSolverMultistepScheduler,
}


def sampling_scheduler(name: str, noise_schedule_config: dict):
    return _SCHEDULERS[name].from_config(noise_schedule_config)
