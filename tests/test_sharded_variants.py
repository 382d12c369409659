"""What a sharded denoiser (`distributed.shard_parts`, modules/trainer/sharding.py) trains beyond
test_distributed.py's LoRA and AdamW fine-tune: every adapter algorithm on the sharded base, a
sharded fine-tune with schedule-free AdamW, an EMA and gradient accumulation (sampled), and one with
Lion, each two-process run (batch 1 each, gloo on the CPU) compared with one process of batch 2;
and stochastic rounding of the sharded bfloat16 unet, stopped and resumed. All two-process runs go
one after another in one pair of spawned processes (test_distributed.py's worker), one epoch each,
while the one-process references train in the test process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import SHARDED, SHARDED_FINE_TUNE, _concepts, _config, _dumped, _start_two, _wait_for_two

# One epoch; Adam's eps near the adapters' gradients (default 1e-8: far below them), so a step
# follows the gradient's size. With a tiny eps, Adam divides each gradient by its own running size,
# and an element whose gradient is small next to the terms summed into it steps by the rounding
# noise of that sum: the one process's reference summed with 2 intra-op threads instead of the
# ranks' 1 differed from the ranks by 2.3x the tolerance in LoHa's hada_w?_a (issue 26), 0.03x
# with this eps; the trained factors still move ~2000x the tolerance.
ONE_EPOCH = {"schedule": {"epochs": 1}, "optimizer": {"eps": 1e-4}}
ADAPTERS = {
    "loha": {"adapter": {"type": "loha"}},
    "lokr": {"adapter": {"type": "lokr", "factor": 4}},
    # DoRA reads the base weight in its forward hook: there the block's weights are all-gathered whole
    "dora": {"adapter": {"type": "lora", "dora": True, "dora_axis": "input"}},
    "oft": {"adapter": {"type": "oft", "block_size": 4}},
}
# Schedule-free AdamW (its averaged point is what samples and saves use) with an EMA of that (a
# fast decay, so the average differs from the weights) and gradient accumulation 2 (the three
# global batches of the epoch make a step of two and one of one), sampled after each step (a
# training step after a sample: its forward must not reuse the whole weights the sample gathered)
EMA_AND_ACCUMULATION = {
    **SHARDED_FINE_TUNE, "optimizer": {"type": "schedule_free_adamw", "lr": 1e-3, "eps": 1e-3},
    "ema": {"enabled": True, "decay": 0.5},
    "schedule": {**SHARDED_FINE_TUNE["schedule"], "epochs": 1, "gradient_accumulation": 2, "sample_every": "1 steps"},
}
ROUNDED_WITH_EMA = {
    **SHARDED_FINE_TUNE, "method": {**SHARDED_FINE_TUNE["method"], "stochastic_rounding": True},
    "model": {"parts": {"unet": {"weight_dtype": "bfloat16"}}}, "ema": {"enabled": True, "decay": 0.5},
    "schedule": {**SHARDED_FINE_TUNE["schedule"], "epochs": 1},
}
# Lion (a backup at the end: its test reads the momentum)
LION = {"method": SHARDED_FINE_TUNE["method"], "optimizer": {"type": "lion", "lr": 1e-4},
        "schedule": {"epochs": 1, "max_grad_norm": 1.5, "backup_every": "1 epochs"}}
SAMPLED = {"sampling": {"prompts": [{"prompt": "a red square", "steps": 2, "width": 64, "height": 64}]}}


@pytest.fixture(scope="module")
def sharded_variants(tmp_path_factory, tiny_model):
    """{name: (the two-process run's config as dumped, the one-process reference's output path)}."""
    from modules.cli.train_command import run_training

    tmp = tmp_path_factory.mktemp("sharded-variants")
    _concepts(tmp)
    cases = {**{name: (ONE_EPOCH, overlay) for name, overlay in ADAPTERS.items()},
             "ema": (EMA_AND_ACCUMULATION, SAMPLED),
             "lion": (LION, {})}
    runs, configs = [], {}
    for name, overlays in cases.items():
        configs[name] = _dumped(_config(tiny_model, tmp, name, 1, "cache", SHARDED, *overlays))
        runs.append(([configs[name]] * 2, None))
    # R: one epoch on bfloat16 weights with stochastic rounding and an EMA (each rank rounds its
    # slice with its own noise, so no one-process reference); RB: the same stopped at step 2 (a
    # backup of whole weights, optimizer state and average) and resumed
    for name, stop_at in (("rounded", None), ("rounded-stopped", 2)):
        configs[name] = _dumped(_config(tiny_model, tmp, name, 1, "cache", SHARDED, ROUNDED_WITH_EMA))
        runs.append(([configs[name]] * 2, stop_at))
    stopped = configs["rounded-stopped"]
    runs.append(([{**stopped, "backup": {**stopped["backup"], "resume": True}}] * 2, None))
    two = _start_two(runs, tmp / "report")
    try:  # the references train here meanwhile (the two processes wait in collectives much of the time)
        references = {name: run_training(_config(tiny_model, tmp, f"{name}-single", 2, "single-cache", *overlays),
                                         None) for name, overlays in cases.items()}
    finally:
        _wait_for_two(two)
    return {name: (configs[name], references.get(name)) for name in configs}


def _assert_equal_files(parallel_path, reference_path, atol):
    parallel, reference = load_file(str(parallel_path)), load_file(str(reference_path))
    assert reference.keys() == parallel.keys()
    for key in reference:
        torch.testing.assert_close(parallel[key], reference[key], rtol=1e-4, atol=atol, msg=key)


@pytest.mark.parametrize("algorithm", list(ADAPTERS))
def test_every_adapter_on_a_sharded_base_equals_one_process_with_twice_the_batch(sharded_variants, algorithm):
    config, reference = sharded_variants[algorithm]
    _assert_equal_files(config["output"]["path"], reference, atol=2e-6)


def test_a_sharded_schedule_free_fine_tune_with_ema_and_accumulation_equals_one_process(sharded_variants):
    config, reference = sharded_variants["ema"]
    # the file holds the EMA of schedule-free's averaged point, both switched in on every rank
    # before the gather
    _assert_equal_files(config["output"]["path"], reference, atol=1e-6)
    samples = sorted(p.name for p in (Path(config["workspace_dir"]) / "samples").iterdir())
    assert samples == ["step0000001-0.png", "step0000002-0.png"]  # sampled with the average, every rank


def test_stochastic_rounding_of_sharded_bfloat16_weights_trains_and_resumes_exactly(sharded_variants, tiny_model):
    (rounded, _), (stopped, _) = sharded_variants["rounded"], sharded_variants["rounded-stopped"]
    [folder] = [d for d in (Path(stopped["workspace_dir"]) / "backup").iterdir() if "step0000002" in d.name]
    weights = load_file(folder / "adapter.safetensors")
    state = torch.load(folder / "state.pt", weights_only=True)
    conv = weights["fine_tune.unet.conv_in.weight"]
    # whole tensors, as one process writes them: bfloat16 weights stepped through float32 (Adam's
    # moments stay float32, not the weight's bfloat16) and rounded back; the EMA's whole average
    assert conv.dtype == torch.bfloat16 and conv.shape[0] == 32
    moments = [s["exp_avg"] for s in state["optimizer"]["state"].values()]
    assert all(m.dtype == torch.float32 for m in moments) and any(m.shape == conv.shape for m in moments)
    assert state["ema"]["updates"] == 2 and any(s.shape == conv.shape for s in state["ema"]["shadow"])
    base = load_file(tiny_model / "unet" / "diffusion_pytorch_model.safetensors")["conv_in.weight"]
    assert (conv.float() != base.to(torch.bfloat16).float()).float().mean() > 0.5  # it trained
    # the resumed run (each rank's slices, optimizer state, average and random state cut back out
    # of the backup) continued exactly as the uninterrupted one
    _assert_equal_files(stopped["output"]["path"], rounded["output"]["path"], atol=0)


def _backup(config: dict) -> tuple[dict, dict]:
    [folder] = (Path(config["workspace_dir"]) / "backup").iterdir()
    return load_file(folder / "adapter.safetensors"), torch.load(folder / "state.pt", weights_only=True)


def test_a_sharded_lion_fine_tune_equals_one_process(sharded_variants, tiny_model):
    """Lion steps each weight by the sign of a mix of its gradients. In the tiny unet some weights
    have a gradient that is zero but for rounding (biases before a GroupNorm of one channel per
    group): its sign is noise that any other order of summing the batch flips, unsharded data
    parallel too, and so can a weight whose mix of momentum and gradient is near zero (~1 in 10^5
    here). So: the momentum (a smooth mix of gradients) equals one process's everywhere, and the
    weights wherever the gradient is more than rounding, but for at most 1 in 10^4 of them (a
    gradient missing a rank's half, or a slice cut wrong, would move far more)."""
    from diffusers import UNet2DConditionModel

    config, reference = sharded_variants["lion"]
    (weights, state), (reference_weights, reference_state) = _backup(config), _backup(
        {"workspace_dir": str(Path(reference).parent.parent / "ws")})
    names = [name for name, _ in UNet2DConditionModel.from_pretrained(tiny_model / "unet").named_parameters()]
    momenta, reference_momenta = state["optimizer"]["state"], reference_state["optimizer"]["state"]
    assert len(momenta) == len(names)
    compared = total = flipped = 0
    for index, name in enumerate(names):
        momentum, reference_momentum = momenta[index]["exp_avg"], reference_momenta[index]["exp_avg"]
        torch.testing.assert_close(momentum, reference_momentum, rtol=1e-4, atol=1e-8, msg=name)
        signal = reference_momentum.abs() > 1e-8
        key = f"fine_tune.unet.{name}"
        flipped += int(((weights[key] - reference_weights[key]).abs() > 1e-7)[signal].sum())
        compared, total = compared + int(signal.sum()), total + signal.numel()
    assert compared > 0.95 * total and flipped <= 1e-4 * compared, (compared, total, flipped)


@pytest.mark.parametrize("algorithm", ["dora", "oft"])
def test_a_sharded_base_weight_read_outside_a_forward_is_gathered_whole(tmp_path, algorithm):
    """A merge (or any read of the base weight outside the block's forward) sees the whole weight,
    not the rank's slice FSDP leaves there (one process in a group of one: its slice is a DTensor)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from modules.adapters.lora import LoRAModule
    from modules.adapters.oft import OFTModule

    torch.manual_seed(0)
    layer = nn.Linear(6, 8)
    adapter = (LoRAModule("l", layer, rank=2, alpha=2.0, dora=True, dora_axis="input") if algorithm == "dora"
               else OFTModule("l", layer, block_size=4))
    with torch.no_grad():
        for parameter in adapter.parameters():  # a delta that is not zero
            parameter.add_(torch.randn_like(parameter) * 0.1)
    expected = adapter.merged_weight()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
        assert isinstance(layer.weight, torch.distributed.tensor.DTensor)
        torch.testing.assert_close(adapter.merged_weight(), expected)
    finally:
        dist.destroy_process_group()
