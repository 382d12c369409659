"""Whether a weight mode's training graph compiles here, found by asking the compiler.

Two things can stop torch.compile: the device (inductor generates code only for the device types
that register a code generator with it: cpu, cuda, xpu, mps; on any other, the first compiled call
fails with a KeyError naming the device type), and the weight mode (whether bitsandbytes' or
torchao's ops trace depends on their versions and on the device, so a static table would be wrong
somewhere). So the trainer checks the device's code generator, then asks dynamo to trace the
forward of one layer of the mode on the train device, before compiling the real model; a missing
code generator, a graph break or a tracing error turns compile off for that part, with the
reason in the log. Measured on torch 2.13 CPU (tests pin it): every mode here traces as one graph.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def _probe_layer(mode: str, device: torch.device, compute_dtype: torch.dtype) -> nn.Module:
    from modules.quantization.replace import quantize_model_
    from modules.quantization.weight_modes import DENSE_DTYPES

    model = nn.Sequential(nn.Linear(64, 64))
    if mode in DENSE_DTYPES:
        return model.to(device=device, dtype=DENSE_DTYPES[mode])
    quantize_model_(model, "probe", mode, compute_dtype)
    return model.to(device)


def graph_blocker(module: nn.Module, example: torch.Tensor) -> str | None:
    """Why `module`'s forward does not trace as one graph, or None when it does (dynamo traces
    the forward; the backward graph is derived from it by AOT autograd)."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(module)(example)
    except Exception as error:  # any tracing failure means "does not compile", which is the answer
        return f"tracing failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    finally:
        torch._dynamo.reset()
    if explanation.graph_break_count:
        reasons = "; ".join(str(b.reason).splitlines()[0][:120] for b in explanation.break_reasons[:2])
        return f"{explanation.graph_break_count} graph break(s): {reasons}"
    return None


def device_blocker(device: torch.device) -> str | None:
    """Why inductor cannot generate code for `device`, or None when it can."""
    from torch._inductor.codegen.common import get_scheduling_for_device, init_backend_registration

    init_backend_registration()  # registers the built-in device types (idempotent)
    if get_scheduling_for_device(device.type) is None:
        return f"torch.compile (inductor) has no code generator for {device.type} devices"
    return None


@functools.cache
def compile_blocker(mode: str, device: str = "cpu", compute_dtype: torch.dtype = torch.float32) -> str | None:
    """Why training with weights in `mode` cannot be compiled on `device`, or None."""
    device = torch.device(device)
    blocker = device_blocker(device)
    if blocker:
        return blocker
    try:
        layer = _probe_layer(mode, device, compute_dtype)
    except Exception as error:  # the mode itself cannot run here: nothing to compile
        return f"{mode} layers cannot be built on {device}: {error}"
    example = torch.randn(32, 64, device=device, dtype=compute_dtype, requires_grad=True)
    blocker = graph_blocker(layer, example)
    return f"{mode} weights: {blocker}" if blocker else None
