"""Named GPU classes for the planner's seconds per step: nominal spec-sheet figures (memory, memory
bandwidth, host link bandwidth as usually reached, dense bf16 tensor throughput with float32
accumulation). Estimates only: nothing here is measured (issue 24's GPU check will fill measured
throughputs). Torch-free, so the GUI and `launch.py plan --help` can list them."""

from __future__ import annotations

from dataclasses import dataclass

from modules.util.did_you_mean import did_you_mean

# the share of the nominal bf16 throughput a training step reaches (attention, norms and small
# matmuls run far below peak); a planning figure, not a measurement
COMPUTE_EFFICIENCY = 0.4


@dataclass(frozen=True)
class GpuClass:
    name: str
    memory: int  # bytes
    memory_bandwidth: float  # bytes/s
    host_link: float  # bytes/s host<->device (PCIe as reached with pinned memory)
    bf16_flops: float  # FLOP/s, dense tensor cores


GiB, GB = 2**30, 1e9

GPU_CLASSES = {g.name: g for g in (
    GpuClass("rtx3060", 12 * GiB, 360 * GB, 24 * GB, 51e12),
    GpuClass("rtx3090", 24 * GiB, 936 * GB, 24 * GB, 71e12),
    GpuClass("rtx4060ti-16", 16 * GiB, 288 * GB, 12 * GB, 44e12),
    GpuClass("rtx4070", 12 * GiB, 504 * GB, 24 * GB, 117e12),
    GpuClass("rtx4080", 16 * GiB, 717 * GB, 24 * GB, 195e12),
    GpuClass("rtx4090", 24 * GiB, 1008 * GB, 24 * GB, 165e12),
    GpuClass("rtx5090", 32 * GiB, 1792 * GB, 48 * GB, 209e12),
    GpuClass("a100-80g", 80 * GiB, 2039 * GB, 24 * GB, 312e12),
    GpuClass("h100-sxm", 80 * GiB, 3350 * GB, 48 * GB, 989e12),
)}
DEFAULT_GPU_CLASS = "rtx4090"


def gpu_class(name: str | None) -> GpuClass:
    """The class named (case-insensitive), the default for None; ValueError naming the known ones."""
    key = (name or DEFAULT_GPU_CLASS).lower()
    if key not in GPU_CLASSES:
        raise ValueError(f"unknown GPU class {name!r}{did_you_mean(key, GPU_CLASSES)} (known: {', '.join(GPU_CLASSES)})")
    return GPU_CLASSES[key]


def step_seconds(flops: float, transfer_bytes: float, gpu: GpuClass) -> float:
    """Compute at COMPUTE_EFFICIENCY of the nominal throughput, and host transfers overlapped with
    it (the conductor prefetches on a side stream): the slower of the two."""
    return max(flops / (gpu.bf16_flops * COMPUTE_EFFICIENCY), transfer_bytes / gpu.host_link)
