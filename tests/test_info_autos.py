"""`launch.py info` says how the autos that resolve against the train device's free memory resolve,
as the run's log and `launch.py plan` do (trainer/planned_autos.py): where the device cannot say what
of it is free (the CPU: no plan is made), `sampling.vae_tiling: auto` is untiled and
`offload_fraction: auto` parks nothing; where it can (the fake device with a capacity, CUDA), both go
through each run's plan against the free memory, and per family `info` gives what the weights alone
would park."""

from __future__ import annotations

import json
from contextlib import contextmanager


def info(capsys, *arguments: str) -> tuple[str, dict]:
    import launch

    assert launch.main(["info", *arguments]) == 0
    text = capsys.readouterr().out
    assert launch.main(["info", "--json", *arguments]) == 0
    return text, json.loads(capsys.readouterr().out)


@contextmanager
def free_on_the_fake_device(nbytes: int):
    """The fake device says `nbytes` are free (a capacity over what it holds) while the block runs."""
    import torch

    torch.fakegpu.set_memory_capacity(torch.fakegpu.memory_allocated() + nbytes)
    try:
        yield
    finally:
        torch.fakegpu.set_memory_capacity(None)


def test_info_says_vae_tiling_auto_is_untiled_where_the_device_cannot_say_what_is_free(capsys):
    text, data = info(capsys, "--device", "cpu")
    assert data["vae_tiling_auto"]["planned"] is False and data["vae_tiling_auto"]["value"] is False
    line = next(line for line in text.splitlines() if "sampling.vae_tiling auto" in line)
    assert "untiled: a run on cpu is not planned" in line, line


def test_info_says_vae_tiling_auto_goes_through_the_plan_against_the_free_memory(capsys, fake_device):
    with free_on_the_fake_device(3 * 2**30):
        text, data = info(capsys, "--device", str(fake_device))
    tiling = data["vae_tiling_auto"]
    assert tiling["planned"] is True and tiling["value"] is None
    assert 2 * 2**30 < tiling["budget_bytes"] <= 3 * 2**30
    line = next(line for line in text.splitlines() if "sampling.vae_tiling auto" in line)
    assert "free now" in line and "through each run's plan against the free memory" in line, line

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
    with free_on_the_fake_device(3 * 2**30):
        text, data = info(capsys, "--device", str(fake_device))
    offload = data["offload_auto"]
    assert offload["planned"] is True and 2 * 2**30 < offload["budget_bytes"] <= 3 * 2**30
    line = next(line for line in text.splitlines() if line.startswith("  offload_fraction auto"))
    assert "free now" in line and "by each run's plan against the free memory" in line, line
    # 3 GiB parks some of FLUX.2's weights: the family lines give the weights-only estimate
    flux2 = data["families"]["flux2"]["recommended"]["offload_fraction"]
    assert any(flux2.values()), flux2
    assert sum("offload_fraction auto, the weights alone:" in line for line in text.splitlines()) == \
        sum(1 for family in data["families"].values() if family["recommended"])
