"""Per-layer quantize time at load, at real FLUX.1 linear sizes: what the streamed loader spends on
each Linear (its `load_dense_weight`, the same call), per weight mode and device.

    python -m benchmarks.quantize_load [--modes nf4 int8 float8] [--shapes 3072x3072 12288x3072 ...]
                                       [--device cpu] [--repeats 2] [--json out.json]

A few layers, not the whole model: each shape is one of FLUX.1's transformer Linears (out x in), and
the FLUX.1 column extrapolates the measured ns per parameter to all of its transformer's Linears
(~11.9 B parameters, counted from the architecture below). The dense weight arrives in bfloat16,
as FLUX.1's checkpoint stores it. With `--device cuda` (or any accelerator) the layer is quantized
there and stored on the CPU, as for a part that will be parked (the slower case: the codes come
back); a device that is not there is reported, not guessed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# FLUX.1 [dev/schnell] transformer Linears: (out, in) -> how many (19 double blocks, 38 single blocks)
HIDDEN, MLP = 3072, 12288
FLUX1_LINEARS = {
    (HIDDEN, HIDDEN): 19 * 8 + 38 * 3,  # double: q, k, v, out for image and text; single: q, k, v
    (MLP, HIDDEN): 19 * 2 + 38,  # MLP up (double: image and text), single: proj_mlp
    (HIDDEN, MLP): 19 * 2,  # MLP down
    (6 * HIDDEN, HIDDEN): 19 * 2,  # double blocks' modulation (norm1, norm1_context)
    (3 * HIDDEN, HIDDEN): 38,  # single blocks' modulation
    (HIDDEN, HIDDEN + MLP): 38,  # single blocks' proj_out
}
DEFAULT_SHAPES = ["3072x3072", "12288x3072", "3072x15360"]


def flux1_linear_parameters() -> int:
    return sum(out * inp * count for (out, inp), count in FLUX1_LINEARS.items())


def time_layer(mode: str, out_features: int, in_features: int, device, repeats: int) -> float:
    """Median seconds to quantize one (out, in) bfloat16 weight into a `mode` layer."""
    import torch
    from torch import nn

    from modules.quantization.replace import load_dense_weight, new_quantized_layer

    torch.manual_seed(0)
    dense = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    with torch.device("meta"):
        shape = nn.Linear(in_features, out_features, bias=False)
    work = None if device.type == "cpu" else device
    times = []
    for _ in range(repeats):
        layer = new_quantized_layer(mode, shape, torch.bfloat16)
        synchronize(device)
        start = time.perf_counter()
        load_dense_weight(layer, "weight", dense, torch.bfloat16, work_device=work)
        synchronize(device)
        times.append(time.perf_counter() - start)
        del layer
    return statistics.median(times)


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_missing(device) -> str | None:
    import torch

    if device.type == "cpu":
        return None
    if device.type == "cuda" and not torch.cuda.is_available():
        return "not measured on a GPU (no CUDA device here)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["nf4", "int8", "float8"])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="out x in, e.g. 3072x3072")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    from modules.quantization.capabilities import detect_capabilities
    from modules.quantization.weight_modes import get_weight_mode

    device = torch.device(args.device)
    missing = device_missing(device)
    if missing:
        print(f"{device}: {missing}")
        return 0
    caps = detect_capabilities(device)
    shapes = [tuple(int(n) for n in text.lower().split("x")) for text in args.shapes]
    total = flux1_linear_parameters()
    print(f"device {device} ({caps.device_name}), torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"FLUX.1 transformer Linears: {total / 1e9:.2f} B parameters")
    rows = []
    for mode in args.modes:
        why_not = get_weight_mode(mode).capability(caps)
        if why_not:
            print(f"{mode}: skipped ({why_not})")
            continue
        time_layer(mode, 64, 64, device, 1)  # warm-up: library imports and first-call setup
        per_parameter = []
        for out_features, in_features in shapes:
            seconds = time_layer(mode, out_features, in_features, device, args.repeats)
            ns = seconds / (out_features * in_features) * 1e9
            per_parameter.append(ns)
            rows.append({"mode": mode, "shape": [out_features, in_features], "seconds": seconds,
                         "ns_per_parameter": ns})
            print(f"{mode:8s} {out_features:6d} x {in_features:<6d} {seconds * 1e3:9.1f} ms  {ns:6.1f} ns/parameter")
        estimate = statistics.median(per_parameter) * total / 1e9
        rows.append({"mode": mode, "flux1_transformer_seconds": estimate})
        print(f"{mode:8s} FLUX.1 transformer (extrapolated): {estimate / 60:.1f} min")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "threads": torch.get_num_threads(),
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
