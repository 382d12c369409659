"""bitsandbytes is probed on the train device, not on the CPU: its CPU and CUDA kernels are separate
builds, so a CPU round trip says nothing about whether nf4 runs on the GPU."""

from __future__ import annotations

import pytest

from modules.quantization import capabilities


@pytest.fixture
def fresh_probe_cache():
    capabilities.has_bitsandbytes.cache_clear()
    yield
    capabilities.has_bitsandbytes.cache_clear()  # the next test must not see a monkeypatched answer


def test_detect_capabilities_probes_bitsandbytes_on_the_train_device(fake_device, monkeypatch, fresh_probe_cache):
    asked = []
    monkeypatch.setattr(capabilities, "has_functional_torchao", lambda: False)  # not what is asked here
    monkeypatch.setattr(capabilities, "_probe_bitsandbytes", lambda device="(none named)": asked.append(device) or True)
    caps = capabilities.detect_capabilities(fake_device)
    assert asked == [caps.device] and caps.device.startswith("fakegpu")
    capabilities.detect_capabilities("cpu")
    assert asked == [caps.device, "cpu"]  # cached per device, not once for all


def test_bitsandbytes_round_trip_runs_on_the_named_device(fake_device, fresh_probe_cache):
    pytest.importorskip("bitsandbytes")
    assert capabilities._probe_bitsandbytes(str(fake_device))  # LinearNf4 does the math on the CPU there
    assert capabilities._probe_bitsandbytes("cpu")
    assert not capabilities._probe_bitsandbytes("meta")  # nothing computes on meta: the probe says so
