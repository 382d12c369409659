"""Versions (Python, torch and its CUDA, the project's packages), the device, and nvidia-smi."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess

# the project's packages, as requirements.txt names them
PACKAGES = ["torch", "diffusers", "transformers", "peft", "accelerate", "safetensors", "torchao", "bitsandbytes",
            "pydantic", "pydantic-core", "huggingface-hub", "numpy", "pillow", "prodigyopt", "schedulefree",
            "lion-pytorch", "came-pytorch", "psutil", "tensorboard", "triton", "pytest", "lycoris-lora"]
NEEDED = ["torch", "diffusers", "transformers", "pydantic", "safetensors"]  # nothing runs without these


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command(command: list[str]) -> str | None:
    if not shutil.which(command[0]):
        return None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"failed: {error}"
    return (done.stdout + done.stderr)[-4000:]


def _commit() -> str | None:
    """The checkout's commit (a copied tree without .git has none)."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def run(context) -> dict:
    import torch

    versions = {name: _version(name) for name in PACKAGES}
    figures = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
               "cuda_available": torch.cuda.is_available(), "packages": versions,
               "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
               "commit": _commit(),
               "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        figures.update(device=properties.name, capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                       memory_gib=round(properties.total_memory / 2**30, 2), device_count=torch.cuda.device_count(),
                       bf16_supported=torch.cuda.is_bf16_supported())
    else:
        figures["device"] = "cpu"
    figures["nvidia_smi"] = _command(["nvidia-smi"]) or "not found"
    missing = [name for name in NEEDED if versions[name] is None]
    if missing:
        return {"status": "failed", "figures": figures,
                "reason": f"missing {', '.join(missing)}: run tools/gpu_check/fetch_wheels.sh where PyPI is reachable"}
    return {"status": "passed", "figures": figures}
