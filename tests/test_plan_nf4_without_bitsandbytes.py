"""The planner's nf4 layers hold no codes (meta): their dense weight is a shape, made without
importing bitsandbytes, whose import compiles its kernels through torch._inductor (1.4 CPU s of a
`launch.py plan` process for an nf4 preset such as Qwen-Image-Edit LoRA 16GB)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_an_nf4_layer_on_meta_dequantizes_without_importing_bitsandbytes():
    pytest.importorskip("bitsandbytes")  # (where it is installed, a plan must still not import it)
    code = ("import sys, torch\n"
            "from modules.quantization.linear_nf4 import LinearNf4\n"
            "layer = LinearNf4(64, 32, False, torch.bfloat16, device='meta')\n"
            "weight = layer.unquantized_weight(torch.bfloat16, 'meta')\n"
            "print(tuple(weight.shape), weight.is_meta, 'bitsandbytes' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "(32, 64) True False", done.stdout
