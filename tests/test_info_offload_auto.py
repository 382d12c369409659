"""`launch.py info` says how `offload_fraction: auto` resolves on the train device, as the run does
(trainer/planned_autos.py): nothing parked where the device cannot say what of it is free (the CPU:
no plan is made), through each run's plan against the free memory where it can (the fake device
with a capacity, CUDA), with per family what the weights alone would need."""

from __future__ import annotations

import json


def info(capsys, *arguments: str) -> tuple[str, dict]:
    import launch

    assert launch.main(["info", *arguments]) == 0
    text = capsys.readouterr().out
    assert launch.main(["info", "--json", *arguments]) == 0
    return text, json.loads(capsys.readouterr().out)


def test_info_says_offload_auto_parks_nothing_where_the_device_cannot_say_what_is_free(capsys):
    text, data = info(capsys, "--device", "cpu")
    assert data["offload_auto"]["planned"] is False
    assert all(f == 0.0 for family in data["families"].values() if family["recommended"]
               for f in family["recommended"]["offload_fraction"].values())
    lines = [line for line in text.splitlines() if "offload_fraction auto" in line]
    # one machine line, no family line that reads as if a budget were known ("everything fits")
    assert len(lines) == 1 and "nothing parked: a run on cpu is not planned" in lines[0], lines
    assert "on a GPU it is resolved at train time" in lines[0]


def test_info_says_offload_auto_goes_through_the_plan_against_the_free_memory(capsys, fake_device):
    import torch

    torch.fakegpu.set_memory_capacity(torch.fakegpu.memory_allocated() + 3 * 2**30)
    try:
        text, data = info(capsys, "--device", str(fake_device))
    finally:
        torch.fakegpu.set_memory_capacity(None)
    offload = data["offload_auto"]
    assert offload["planned"] is True and 2 * 2**30 < offload["budget_bytes"] <= 3 * 2**30
    line = next(line for line in text.splitlines() if line.startswith("  offload_fraction auto"))
    assert "free now" in line and "by each run's plan against the free memory" in line, line
    # 3 GiB parks some of FLUX.2's weights: the family lines give the weights-only estimate
    flux2 = data["families"]["flux2"]["recommended"]["offload_fraction"]
    assert any(flux2.values()), flux2
    assert sum("offload_fraction auto, the weights alone:" in line for line in text.splitlines()) == \
        sum(1 for family in data["families"].values() if family["recommended"])
