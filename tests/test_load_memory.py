"""Peak RAM while loading stays near the final model: the checkpoint is streamed one tensor at a
time and each is cast or quantized into place before the next is read (docs/architecture.md, lifecycle 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory) -> Path:
    """~300 MB of float32 weights: a UNet with three transformer layers per block, so Linear
    layers (what quantization replaces) hold about half of its weights."""
    from modules.model.sd15 import SD15Family

    return SD15Family.make_tiny_model(
        tmp_path_factory.mktemp("mid") / "model",
        unet=dict(sample_size=32, block_out_channels=(256, 512), layers_per_block=1, transformer_layers_per_block=3,
                  cross_attention_dim=512, attention_head_dim=8),
        text=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8),
    )


def measure(model: Path, mode: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "benchmarks.load_memory", "--model", str(model), "--mode", mode],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
@pytest.mark.parametrize("mode", ["bfloat16", "float8"])
def test_peak_ram_during_load_is_within_15_percent_of_the_final_model(mode, mid_model):
    result = measure(mid_model, mode)
    assert result["final_mb"] > 100, result  # the measurement saw the model
    assert result["peak_over_final"] <= 1.15, result
