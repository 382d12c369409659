"""What this machine can run: which base-weight precision modes work, and which run fast.

Every answer here comes from *running* a tiny piece of the real code path, never from version
numbers or "the import succeeded": a torchao whose `quantize_` is a no-op imports cleanly, a
CPU build may lack a float8 cast, and `torch._int_mm` / `torch._scaled_mm` exist as names on
builds and devices where they raise. The probes are small (a 32x32 Linear at most) and the
ones of the installed libraries (torchao; bitsandbytes per device) are cached per process.

`detect_capabilities()` does all the device calls; `working_modes()` and `mode_support()` are
pure functions of the resulting `Capabilities`, so the precision policy (policy.py) and the
tests can reason about any machine without having it.
"""

from __future__ import annotations

import functools
import math
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from modules.quantization.weight_modes import (  # noqa: F401  (ALL_MODES, QUANTIZED_MODES re-exported)
    ALL_MODES,
    DENSE_MODE_NAMES,
    QUANTIZED_MODES,
    get_weight_mode,
    weight_mode_names,
)


# --- library probes (cached: the answer cannot change within a process) ------------------------

def _private_rng():
    """Probes build random layers; a run that calls detect_capabilities() after seeding must get
    the same random numbers as one that does not, so the CPU RNG state is restored afterwards."""
    return torch.random.fork_rng(devices=[])


def _stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a (possibly subclassed) tensor really stores: a tensor subclass such as torchao's
    Int8Tensor reports the *original* dtype and shape, so its own numel()*element_size() would
    say nothing shrank; its inner tensors (`__tensor_flatten__`) are what is stored."""
    if type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(_stored_bytes(inner) for inner in (getattr(tensor, name) for name in names) if inner is not None)
    return tensor.numel() * tensor.element_size()


def quantize_really_changes_linear(quantize: Callable, config_factory: Callable) -> bool:
    """Does `quantize(model, config_factory())` really quantize a tiny nn.Linear, in place, into
    something that still computes about the same thing?

    "Really" means the weight is no longer a plain tensor (torchao swaps in a tensor subclass) or
    its stored bytes shrank. Without this check a stub or broken torchao whose `quantize_` does
    nothing would be reported as working, and a run asking for int8 would silently train on
    full-size weights (and run out of memory where the policy promised it fits).
    """
    linear = nn.Linear(32, 32)  # draws from the global RNG: _probe_torchao() runs this under _private_rng()
    before_type = type(linear.weight)
    before_bytes = _stored_bytes(linear.weight)
    probe = torch.randn(4, 32)
    with torch.no_grad():
        expected = linear(probe)
    quantize(linear, config_factory())
    weight = linear.weight
    changed = (type(weight) is not before_type and type(weight) not in (torch.Tensor, nn.Parameter)) or (
        _stored_bytes(weight) < before_bytes
    )
    if not changed:
        return False
    # a quantizer that mangles the weight is no better than one that does nothing
    with torch.no_grad():
        got = linear(probe).float()
    return bool(torch.isfinite(got).all() and (got - expected).norm() <= 0.05 * expected.norm())


def _probe_torchao() -> bool:
    """Uncached: the exact symbols the int8 path imports, and a real quantization of a Linear."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        return False
    try:
        with _private_rng():
            return quantize_really_changes_linear(quantize_, Int8WeightOnlyConfig)
    except Exception:  # noqa: BLE001 - any failure of the trial means int8 cannot be offered
        return False


@functools.cache
def has_functional_torchao() -> bool:
    """torchao's int8 weight-only path imports AND really quantizes (cached; `.cache_clear()` it
    or call `_probe_torchao()` to re-probe)."""
    return _probe_torchao()


def _probe_bitsandbytes(device: str = "cpu") -> bool:
    """Uncached: bitsandbytes imports and an nf4 quantize/dequantize round trip through LinearNf4
    works on `device` (the train device: bitsandbytes' CPU and CUDA kernels are separate builds,
    so a CPU answer says nothing about the GPU; on devices it has no kernels for LinearNf4 does
    the math on the CPU, and so does this probe)."""
    try:
        import bitsandbytes.functional  # noqa: F401
    except Exception:  # noqa: BLE001 - bitsandbytes raises more than ImportError when its native lib is missing
        return False
    try:
        from modules.quantization.linear_nf4 import LinearNf4

        with _private_rng():
            weight = torch.randn(64, 64)
        layer = LinearNf4(64, 64, False, torch.float32, device=device)
        layer.quantize_weight(weight.to(device))
        restored = layer.unquantized_weight(torch.float32, device).float().cpu()
        # nf4 is lossy (~10% relative error on Gaussian weights); 30% means "it computed something real"
        return bool(
            layer.weight.numel() * layer.weight.element_size() < weight.numel() * weight.element_size()
            and restored.shape == weight.shape
            and (restored - weight).norm() <= 0.3 * weight.norm()
        )
    except Exception:  # noqa: BLE001
        return False


@functools.cache
def has_bitsandbytes(device: str = "cpu") -> bool:
    """bitsandbytes imports and nf4 round-trips on `device` (cached per device; see `_probe_bitsandbytes`)."""
    return _probe_bitsandbytes(device)


# --- per-device probes ---------------------------------------------------------------------

def _dense_dtype_works(dtype: torch.dtype, device: torch.device) -> bool:
    try:
        layer = nn.Linear(8, 8).to(device=device, dtype=dtype)
        result = layer(torch.ones(2, 8, device=device, dtype=dtype)).float().sum().item()
        return not math.isnan(result)  # some backends "run" a dtype they only emulate, and give NaN
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _float8_works(device: torch.device) -> bool:
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        return False
    try:
        values = torch.tensor([0.5, -1.0, 2.0, 448.0], device=device)
        return bool(torch.equal(values.to(dtype).to(torch.float32), values))  # all exact in e4m3
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _int_mm_works(device: torch.device) -> bool:
    # CUDA wants m > 16 and k, n multiples of 8: 32x64 @ 64x32 is valid everywhere
    try:
        a = torch.ones(32, 64, dtype=torch.int8, device=device)
        b = torch.ones(64, 32, dtype=torch.int8, device=device)
        out = torch._int_mm(a, b)
        return out.dtype == torch.int32 and int(out[0, 0].item()) == 64
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return False


def _scaled_mm_works(device: torch.device) -> bool:
    # the call LinearW8A8 makes: row-wise scales (a tensor-wise probe passes on builds that refuse
    # them), bfloat16 output; a float32 compute dtype falls back to that output (linear_w8a8.py)
    from modules.quantization.linear_w8a8 import rowwise_scaled_mm_runs

    return rowwise_scaled_mm_runs(device, torch.bfloat16)


def _system_memory() -> tuple[int | None, int | None]:
    """(total, available) RAM in bytes: /proc/meminfo's MemAvailable counts reclaimable page cache,
    which MemFree does not; os.sysconf is the fallback off Linux (it only knows free pages)."""
    try:
        fields = {}
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024  # the file says kB and means KiB
        return fields.get("MemTotal"), fields.get("MemAvailable", fields.get("MemFree"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        return None, None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


@dataclass(frozen=True)
class Capabilities:
    """What one train device (and the installed libraries) can do. Plain data: build one by hand
    to ask the policy about another machine."""

    device: str  # as torch prints it: "cpu", "cuda:0", ...
    device_name: str
    cuda: bool
    compute_capability: tuple[int, int] | None
    total_memory: int | None  # bytes; None where the device does not say
    free_memory: int | None  # bytes free now (CUDA: mem_get_info; CPU/MPS: MemAvailable)
    dense_dtypes: tuple[str, ...]  # which of float32/bfloat16/float16 run a Linear on the device
    float8_dtypes: bool  # torch.float8_e4m3fn exists and casts round-trip on the device
    torchao_int8: bool  # has_functional_torchao()
    bitsandbytes: bool  # has_bitsandbytes(device)
    int_mm: bool  # torch._int_mm runs on the device (W8A8 int8's fast path)
    scaled_mm: bool  # torch._scaled_mm runs on the device (W8A8 fp8's fast path, where fast: see below)

    def as_dict(self) -> dict:
        data = dict(self.__dict__)
        data["dense_dtypes"] = list(self.dense_dtypes)
        data["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        return data


def detect_capabilities(device: str | torch.device) -> Capabilities:
    """Probe `device` (and the quantization libraries) by running tiny ops on it."""
    with _private_rng():
        return _detect(torch.device(device))


def _detect(device: torch.device) -> Capabilities:
    cuda = device.type == "cuda"
    if cuda:
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        name = torch.cuda.get_device_name(device)
        compute_capability = tuple(torch.cuda.get_device_capability(device))
        free, total = torch.cuda.mem_get_info(device)
    else:
        compute_capability = None
        if device.type in ("cpu", "mps"):
            # MPS shares the system RAM (unified memory), so RAM is its budget too
            name = _cpu_name() if device.type == "cpu" else "Apple MPS"
            total, free = _system_memory()
        else:
            # an unknown backend: say nothing rather than guess ("not cpu" does not mean cuda)
            name, total, free = device.type, None, None
    return Capabilities(
        device=str(device),
        device_name=name,
        cuda=cuda,
        compute_capability=compute_capability,
        total_memory=total,
        free_memory=free,
        dense_dtypes=tuple(
            mode for mode in DENSE_MODE_NAMES
            if mode == "float32" or _dense_dtype_works(get_weight_mode(mode).torch_dtype(), device)
        ),
        float8_dtypes=_float8_works(device),
        torchao_int8=has_functional_torchao(),
        bitsandbytes=has_bitsandbytes(str(device)),
        int_mm=_int_mm_works(device),
        scaled_mm=_scaled_mm_works(device),
    )


# --- pure: modes from capabilities ------------------------------------------------------------

@dataclass(frozen=True)
class ModeSupport:
    works: bool
    # True/False only for modes that have a kernel of their own (W8A8: int8/fp8 matmuls); None for
    # dense modes (nothing to speed up) and weight-only modes (float8, int8, nf4), which save
    # memory by design and dequantize in forward everywhere
    fast_kernel: bool | None
    why: str  # the reason it does not work, or the kernel it uses


def mode_support(capabilities: Capabilities) -> dict[str, ModeSupport]:
    """Every registered weight mode (auto excluded) with whether it works here and how it runs,
    as its entry's probes say (weight_modes.py)."""
    support = {}
    for name in weight_mode_names():
        mode = get_weight_mode(name)
        why_not = mode.capability(capabilities)
        if why_not is not None:
            support[name] = ModeSupport(False, None if mode.fast_kernel is None else False, why_not)
        elif mode.fast_kernel is None:
            support[name] = ModeSupport(True, None, mode.how)
        else:
            slow = mode.fast_kernel(capabilities)
            how = mode.how if slow is None else f"dequantize fallback ({slow})"
            support[name] = ModeSupport(True, slow is None, how)
    return support


def working_modes(capabilities: Capabilities) -> list[str]:
    """The weight_dtype names (auto excluded) that work with these capabilities, in ALL_MODES order."""
    return [mode for mode, support in mode_support(capabilities).items() if support.works]


def fast_kernel_modes(capabilities: Capabilities) -> list[str]:
    """The working modes whose own fast kernel runs here (W8A8 with _int_mm / sm_89+ _scaled_mm)."""
    return [mode for mode, support in mode_support(capabilities).items() if support.works and support.fast_kernel]
