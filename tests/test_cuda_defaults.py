"""CUDA's defaults the trainer sets without a GPU to check them on: TF32 float32 matmuls on a CUDA
train device (the `tf32` setting turns it off) and the expandable-segments allocator, set before
torch is imported unless the user set one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def matmul_precision():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def fake_trainer(device: str, tf32: bool):
    """What setup_train_device reads, with no part to move (so no CUDA call is made)."""
    return SimpleNamespace(device=torch.device(device), config=SimpleNamespace(tf32=tf32, temp_device="cpu",
                                                                              model=SimpleNamespace(parts={})),
                           family=SimpleNamespace(parts={}, text_parts=()), trained_parts=[], callbacks=None)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_cuda_train_device_gets_tf32_matmuls(matmul_precision, device):
    from modules.trainer.part_setup import setup_train_device

    setup_train_device(fake_trainer(device, tf32=True))
    assert torch.get_float32_matmul_precision() == "high"  # TF32 for float32 matmuls
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # what cuBLAS is told


def test_tf32_false_keeps_full_float32(matmul_precision):
    from modules.trainer.part_setup import setup_train_device

    torch.set_float32_matmul_precision("high")
    setup_train_device(fake_trainer("cuda", tf32=False))
    assert torch.get_float32_matmul_precision() == "highest"


def test_a_cpu_train_device_leaves_the_precision_alone(matmul_precision):
    from modules.trainer.part_setup import setup_train_device

    setup_train_device(fake_trainer("cpu", tf32=True))
    assert torch.get_float32_matmul_precision() == "highest"


def test_tf32_is_on_by_default():
    from modules.config.train_config import TrainConfig

    assert TrainConfig().tf32 is True


def test_the_allocator_gets_expandable_segments_unless_the_user_set_one():
    from launch import default_cuda_allocator

    environ: dict[str, str] = {}
    default_cuda_allocator(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        environ = {name: "max_split_size_mb:128"}
        default_cuda_allocator(environ)
        assert environ == {name: "max_split_size_mb:128"}


def test_launch_sets_the_allocator_before_torch_is_imported():
    probe = ("import os, sys; os.environ.pop('PYTORCH_CUDA_ALLOC_CONF', None); os.environ.pop('PYTORCH_ALLOC_CONF', None)\n"
             "import launch\n"
             "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'), 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["expandable_segments:True", "False"]
