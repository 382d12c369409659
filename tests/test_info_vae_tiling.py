"""`launch.py info` says how `sampling.vae_tiling: auto` resolves on the train device, as the run's
log and `launch.py plan` do: through each run's plan where the device says what memory is free (the
fake device with a capacity, CUDA), untiled where it cannot (the CPU: no plan is made,
trainer/planned_autos.py)."""

from __future__ import annotations

import json


def info(capsys, *arguments: str) -> tuple[str, dict]:
    import launch

    assert launch.main(["info", *arguments]) == 0
    text = capsys.readouterr().out
    assert launch.main(["info", "--json", *arguments]) == 0
    return text, json.loads(capsys.readouterr().out)


def test_info_says_vae_tiling_auto_is_untiled_where_the_device_cannot_say_what_is_free(capsys):
    text, data = info(capsys, "--device", "cpu")
    assert data["vae_tiling_auto"]["planned"] is False and data["vae_tiling_auto"]["value"] is False
    line = next(line for line in text.splitlines() if "sampling.vae_tiling auto" in line)
    assert "untiled: a run on cpu is not planned" in line, line


def test_info_says_vae_tiling_auto_goes_through_the_plan_against_the_free_memory(capsys, fake_device):
    import torch

    torch.fakegpu.set_memory_capacity(torch.fakegpu.memory_allocated() + 3 * 2**30)
    try:
        text, data = info(capsys, "--device", str(fake_device))
    finally:
        torch.fakegpu.set_memory_capacity(None)
    tiling = data["vae_tiling_auto"]
    assert tiling["planned"] is True and tiling["value"] is None
    assert 2 * 2**30 < tiling["budget_bytes"] <= 3 * 2**30
    line = next(line for line in text.splitlines() if "sampling.vae_tiling auto" in line)
    assert "free now" in line and "through each run's plan against the free memory" in line, line
