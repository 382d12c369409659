"""Peak memory of loading one model in one weight mode, measured in a fresh process.

    python -m benchmarks.load_memory --model DIR --mode float8 [--train-dtype bfloat16]

Prints one JSON line: `final_mb` (resident growth the loaded model accounts for), `peak_mb`
(the highest resident growth during the load), `peak_over_final` (their ratio), and the weight
bytes of the UNet (`unet_mb`, and `linear_mb` for its Linear layers alone, as stored), and for the quantized layers
their bytes relative to the same layers in bfloat16 (`quantized_over_bf16`).
The baseline is taken after every import, with the kernel's peak counter reset
(/proc/self/clear_refs), so only the load itself counts. Linux only.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def stored_bytes(module) -> tuple[int, int, int, int]:
    """Bytes as stored: all weights, Linear layers, the quantized layers, and those same quantized
    layers' weights had they been stored in bfloat16 (what the quantization goals compare with)."""
    from torch import nn

    from modules.quantization.base import QuantizedLinear

    def tensor_bytes(tensor) -> int:
        parts = [getattr(tensor, name) for name in getattr(tensor, "tensor_data_names", [])]  # torchao int8
        return sum(t.numel() * t.element_size() for t in parts) if parts else tensor.numel() * tensor.element_size()

    total = linear = quantized = as_bf16 = 0
    for child in module.modules():
        tensors = (child.offload_tensors().values() if isinstance(child, QuantizedLinear)
                   else [*child.parameters(recurse=False), *child.buffers(recurse=False)])
        size = sum(tensor_bytes(t) for t in tensors)
        total += size
        if isinstance(child, (nn.Linear, QuantizedLinear)):
            linear += size
            if isinstance(child, QuantizedLinear):
                quantized += size
                as_bf16 += 2 * (child.in_features * child.out_features + (child.out_features if child.bias is not None else 0))
    return total, linear, quantized, as_bf16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--train-dtype", default="bfloat16")
    args = parser.parse_args()

    from modules.util.library_logs import quiet_library_logs

    quiet_library_logs()
    import diffusers  # noqa: F401  (imports count before the baseline, not in it)
    import transformers  # noqa: F401
    from diffusers import UNet2DConditionModel  # noqa: F401

    from modules.config.loading import build_config
    from modules.model.sd15 import SD15Family
    from modules.quantization.replace import is_quantized_mode
    from modules.util.memory import process_memory

    if is_quantized_mode(args.mode):
        import torch
        from torch import nn

        from modules.quantization.replace import new_quantized_layer, quantize_model_  # noqa: F401
        new_quantized_layer(args.mode, nn.Linear(64, 64), torch.float32)  # imports the mode's layer class
        if args.mode == "int8":
            import torchao.quantization  # noqa: F401
        if args.mode == "nf4":
            import bitsandbytes.functional  # noqa: F401
    config = build_config([{"model": {"base": args.model, "parts": {part: {"weight_dtype": args.mode}
                                                                     for part in ("unet",)}},
                            "train_dtype": args.train_dtype}])
    family = SD15Family(config)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current resident size
    before = process_memory()
    family.load()
    gc.collect()
    after = process_memory()
    final, peak = after["rss"] - before["rss"], after["peak_rss"] - before["rss"]
    unet_bytes, linear_bytes, quantized_bytes, as_bf16 = stored_bytes(family.parts["unet"])
    print(json.dumps({
        "mode": args.mode, "final_mb": round(final / 2**20, 1), "peak_mb": round(peak / 2**20, 1),
        "peak_over_final": round(peak / final, 3), "unet_mb": round(unet_bytes / 2**20, 1),
        "linear_mb": round(linear_bytes / 2**20, 1),
        "quantized_over_bf16": round(quantized_bytes / as_bf16, 3) if as_bf16 else None,
    }))


if __name__ == "__main__":
    main()
