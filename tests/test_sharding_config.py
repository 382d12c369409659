"""What `distributed.shard_parts` refuses, each problem named by its dotted path
(modules/config/distributed_config.py). The sharded runs themselves are in test_distributed.py."""

from __future__ import annotations

import pytest

from conftest import train_config
from modules.config.errors import ConfigError

SHARD_UNET = {"distributed": {"gpus": 2, "shard_parts": ["unet"]}}
FINE_TUNE = {"method": {"type": "fine_tune", "fused_backward": False}}


@pytest.mark.parametrize("overlay, message", [
    ({"distributed": {"gpus": 2, "shard_parts": ["transformer"]}},
     r"distributed\.shard_parts\[0\]: unknown part 'transformer' for family 'sd15' \(parts: .*unet"),
    ({"distributed": {"gpus": 2, "shard_parts": ["text_encoder"]}},
     r"distributed\.shard_parts\[0\]: only the denoiser \(unet\) can be sharded"),
    ({"distributed": {"gpus": 2, "shard_parts": ["unet", "unet"]}}, r"distributed\.shard_parts\[1\]: unet is listed twice"),
    ({"distributed": {"shard_parts": ["unet"]}}, r"distributed\.shard_parts: .*set distributed\.gpus to 2 or more"),
    ({**SHARD_UNET, "model": {"parts": {"unet": {"offload_fraction": 0.5, "gradient_checkpointing": True}}}},
     r"model\.parts\.unet\.offload_fraction: unet is sharded .*set offload_fraction to 0"),
    ({**SHARD_UNET, "model": {"parts": {"unet": {"weight_dtype": "nf4"}}}},
     r"model\.parts\.unet\.weight_dtype: unet is sharded .*nf4"),
    ({**SHARD_UNET, "model": {"parts": {"unet": {"weight_dtype": "int8"}}}}, r"model\.parts\.unet\.weight_dtype: .*int8"),
    ({**SHARD_UNET, **FINE_TUNE, "optimizer": {"type": "adamw_8bit"}},
     r"optimizer\.type: the fine-tune trains the sharded unet .*adamw_8bit cannot step .*bitsandbytes' 8-bit "
     r"kernels step plain tensors only"),
    ({**SHARD_UNET, **FINE_TUNE, "optimizer": {"type": "adafactor"}},
     r"optimizer\.type: .*adafactor cannot step .*its factored second moment is per whole weight"),
    ({**SHARD_UNET, **FINE_TUNE, "optimizer": {"type": "came"}},
     r"optimizer\.type: .*came cannot step .*its factored moments are per whole weight"),
    ({**SHARD_UNET, **FINE_TUNE, "optimizer": {"type": "prodigy"}},
     r"optimizer\.type: .*prodigy cannot step .*Prodigy's step size d sums products over each whole"),
    ({**SHARD_UNET, **FINE_TUNE, "train_dtype": "float16"}, r"train_dtype: float16's loss scaler"),
    ({**SHARD_UNET, "method": {"type": "fine_tune", "fused_backward": True}},
     r"method\.fused_backward: .*set method\.fused_backward to false"),
    ({**SHARD_UNET, "compile": True}, r"compile: torch\.compile of sharded parts"),
])
def test_sharding_refuses_what_it_does_not_support(tiny_model, tmp_path, monkeypatch, overlay, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=message):
        train_config(tiny_model, tmp_path, tmp_path, overlay)


@pytest.mark.parametrize("overlay", [
    SHARD_UNET,  # an adapter on the sharded unet
    {**SHARD_UNET, **FINE_TUNE},  # its own weights, with AdamW
    # with the other optimizers whose sharded step equals one process's, an EMA, accumulation
    # (tests/test_sharded_variants.py)
    {**SHARD_UNET, **FINE_TUNE, "optimizer": {"type": "lion"}, "ema": {"enabled": True}},
    {**SHARD_UNET, **FINE_TUNE, "optimizer": {"type": "schedule_free_adamw"},
     "schedule": {"gradient_accumulation": 2}},
    {**SHARD_UNET, "method": {"type": "fine_tune", "fused_backward": False, "stochastic_rounding": True},
     "model": {"parts": {"unet": {"weight_dtype": "bfloat16"}}}},  # rounded on each rank's slice
    {**SHARD_UNET, **FINE_TUNE, "ema": {"enabled": True}, "model": {"parts": {"unet": {"train": False},
                                                                              "text_encoder": {"train": True}}}},
])
def test_sharding_accepts_what_it_supports(tiny_model, tmp_path, monkeypatch, overlay):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert train_config(tiny_model, tmp_path, tmp_path, overlay).distributed.shard_parts == ["unet"]


def test_a_run_torchrun_started_directly_may_shard_with_gpus_1(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # several machines: torchrun's world, not distributed.gpus
    assert train_config(tiny_model, tmp_path, tmp_path, {"distributed": {"shard_parts": ["unet"]}})
