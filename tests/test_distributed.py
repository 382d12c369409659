"""Data parallel (modules/trainer/distributed.py) on the CPU with gloo: two processes.

Two processes are spawned (not forked: autograd refuses a fork once its device threads run, and
the test session's fake device starts them) and run four trainings in a row with batch 1 each
(imports and the process group paid once): A, uninterrupted; B1, the same stopped at step 4 (a
backup); B2, B1 resumed to the end; C, on the fake device with half the unet offloaded and int8
base weights. The one-process references (batch 2) of A and C train in the test process. The data
has a bucket whose last global batch holds one image, so rank 1 sometimes trains nothing (weight 0).
"""

from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_config
from fake_device import enable_fake_device
from modules.data.shares import batch_share

JOIN_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _concepts(tmp_path: Path) -> None:
    """3 square images and 2 wide ones: two buckets; global batch 2 leaves one square batch of 1."""
    from modules.data.synthetic_images import write_shape_images

    write_shape_images(tmp_path / "square", count=3, width=64, height=64)
    write_shape_images(tmp_path / "wide", count=2, width=96, height=48)


def _config(tiny_model: Path, tmp_path: Path, name: str, batch_size: int, cache: str = "cache", *overlays: dict):
    """Run `name`'s config; all runs share the concepts, the two-process ones their cache."""
    return train_config(tiny_model, tmp_path, tmp_path / name, {
        "concepts": [{"path": str(tmp_path / "square")}, {"path": str(tmp_path / "wide")}],
        "schedule": {"epochs": 2, "batch_size": batch_size},
        "cache_dir": str(tmp_path / cache),
        "seed": 7,
    }, *overlays)


# Run C: each rank parks half the unet's blocks off the (fake) train device and trains on int8 base
# weights; one epoch (its three steps include the uneven batch).
OFFLOADED_AND_QUANTIZED = {
    "model": {"parts": {"unet": {"weight_dtype": "int8", "offload_fraction": 0.5, "gradient_checkpointing": True}}},
    "schedule": {"epochs": 1},
    "train_device": "fakegpu",
}


# Runs S and SB: the unet's weights split across the two processes (FSDP2, modules/trainer/sharding.py)
SHARDED = {"distributed": {"gpus": 2, "shard_parts": ["unet"]}}
# Adam's eps near the gradients' size makes the step follow their scale, and the clip norm lies
# between the global gradient's norm (~2: clipped) and half of it (what averaging instead of summing
# the ranks' gradients would give: not clipped) and above one rank's share of it (what a norm
# missing the other rank's slice would give)
SHARDED_FINE_TUNE = {
    "method": {"type": "fine_tune", "fused_backward": False, "stochastic_rounding": False},
    "optimizer": {"lr": 1e-3, "eps": 1e-3}, "schedule": {"max_grad_norm": 1.5},
}


ONE_EPOCH = {"schedule": {"epochs": 1}}


def _sampled_and_validated(tmp_path: Path) -> dict:
    return {
        "concepts": [{"path": str(tmp_path / "square")}, {"path": str(tmp_path / "wide")},
                     {"path": str(tmp_path / "square"), "validation": True}],
        "sampling": {"prompts": [{"prompt": "a red square", "steps": 2, "width": 64, "height": 64}]},
        "schedule": {"sample_every": "1 epochs", "validate_every": "1 epochs"},
    }


@contextmanager
def _one_thread():
    """The one-process references run on one thread, as the workers do: on two, oneDNN/MKL sum in
    another order, and the LoRA weights come out 1e-5 apart after 3 steps (one process, 1 against 2
    threads, measured), 5x the comparisons' atol: a difference that is not the all-reduce's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _dumped(config) -> dict:
    return json.loads(config.model_dump_json())


class _StopAt:
    """Rank 0's callbacks: ask for a stop after step `step` (the ranks then agree on it)."""

    def __init__(self, commands, step):
        self.commands, self.step = commands, step

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def on_progress(self, progress):
        if progress.step == self.step:
            self.commands.stop()


def _worker(rank: int, world: int, port: int, runs: list[tuple[list[dict], int | None]], report: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from fake_device import enable_fake_device

    enable_fake_device()  # before the first backward pass (as conftest.py does); run C trains on it
    # no plan beside the load, as conftest.py's autouse fixture has it for every test not marked
    # background_plan (a spawned process is beyond its monkeypatch): run C's fake device surely
    # fits, and each rank would start a planning child for a memory event no test here reads
    from modules.trainer import background_plan

    background_plan.start_background_plan = lambda *args, **kwargs: None

    from modules.config.loading import build_config
    from modules.quantization.base import QuantizedLinear
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.commands import TrainCommands
    from modules.trainer.generic_trainer import GenericTrainer
    from modules.trainer.sharding import shard_bytes

    misses, placements = [], []
    try:
        for per_rank, stop_at in runs:
            commands = TrainCommands()
            callbacks = _StopAt(commands, stop_at) if rank == 0 and stop_at else TrainCallbacks()
            trainer = GenericTrainer(build_config([per_rank[rank]]), callbacks, commands)
            try:
                trainer.start()
                misses.append(trainer.dataset.cache_stats["latents"][1] + trainer.dataset.cache_stats["text"][1])
                trainer.train()
                unet = trainer.conductors.get("unet")
                placements.append({"parked": len(unet.parked) if unet else 0, "moves": unet.moves if unet else 0,
                                   "quantized": sum(isinstance(m, QuantizedLinear)
                                                    for m in trainer.family.parts["unet"].modules()),
                                   "unet_bytes": shard_bytes(trainer.family.parts["unet"])})
                trainer.end()
            finally:
                trainer.release()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(report, f"rank{rank}.json").write_text(json.dumps({"misses": misses, "placements": placements}))


def _fork_two(runs, report: Path) -> None:
    _wait_for_two(_start_two(runs, report))


def _start_two(runs, report: Path):
    """The two processes running `runs`, started; the caller may work meanwhile, then waits."""
    import torch.multiprocessing as mp

    report.mkdir(parents=True, exist_ok=True)
    return mp.spawn(_worker, args=(2, _free_port(), runs, str(report)), nprocs=2, join=False)


def _wait_for_two(context) -> None:
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two training processes did not finish (a rank waiting in a collective?)")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory, tiny_model):
    """(the folder, A's, B's and C's configs as dumped, the one-process references of A and C)."""
    from modules.cli.train_command import run_training

    tmp = tmp_path_factory.mktemp("ddp")
    _concepts(tmp)
    with _one_thread():
        reference = load_file(str(run_training(_config(tiny_model, tmp, "single", 2, cache="single-cache"), None)))
    a = _dumped(_config(tiny_model, tmp, "a", 1))
    # rank 1 of run A is given a workspace and output of its own: they must never appear
    a_rank1 = {**a, "workspace_dir": str(tmp / "rank1-ws"), "output": {**a["output"], "path": str(tmp / "rank1-out.safetensors")}}
    b = _dumped(_config(tiny_model, tmp, "b", 1))
    b_resumed = {**b, "backup": {**b["backup"], "resume": True}}
    c = _dumped(_config(tiny_model, tmp, "c", 1, "cache", OFFLOADED_AND_QUANTIZED))
    # S: run A with the unet sharded (and a validation concept and a sample, which every rank runs);
    # rank 1's workspace is its own again. SB: the same stopped at step 4, then resumed.
    s = _dumped(_config(tiny_model, tmp, "s", 1, "cache", SHARDED, _sampled_and_validated(tmp)))
    s_rank1 = {**s, "workspace_dir": str(tmp / "s-rank1-ws"), "output": {**s["output"], "path": str(tmp / "s1.safetensors")}}
    sb = _dumped(_config(tiny_model, tmp, "sb", 1, "cache", SHARDED))
    sb_resumed = {**sb, "backup": {**sb["backup"], "resume": True}}
    # F: a fine-tune of the sharded unet (its weights, gradients and optimizer state split); FB:
    # the same stopped at step 2 (the backup gathers them whole) and resumed (and split again). One
    # epoch: a resume across the epoch's end is B's and SB's to check
    f = _dumped(_config(tiny_model, tmp, "f", 1, "cache", SHARDED, SHARDED_FINE_TUNE, ONE_EPOCH))
    fb = _dumped(_config(tiny_model, tmp, "fb", 1, "cache", SHARDED, SHARDED_FINE_TUNE, ONE_EPOCH))
    fb_resumed = {**fb, "backup": {**fb["backup"], "resume": True}}
    _fork_two([([a, a_rank1], None), ([b, b], 4), ([b_resumed, b_resumed], None), ([c, c], None),
               ([s, s_rank1], None), ([sb, sb], 4), ([sb_resumed, sb_resumed], None),
               ([f, f], None), ([fb, fb], 2), ([fb_resumed, fb_resumed], None)], tmp / "report")
    enable_fake_device()
    with _one_thread():
        c_reference = load_file(str(run_training(
            _config(tiny_model, tmp, "c-single", 2, "single-cache", OFFLOADED_AND_QUANTIZED), None)))
        f_reference = load_file(str(run_training(
            _config(tiny_model, tmp, "f-single", 2, "single-cache", SHARDED_FINE_TUNE, ONE_EPOCH), None)))
    return tmp, a, b, c, reference, c_reference, s, sb, f, fb, f_reference


def test_two_processes_equal_one_with_twice_the_batch(two_process_runs):
    _, a, _, _, reference, _ = two_process_runs[:6]
    parallel = load_file(a["output"]["path"])
    assert reference.keys() == parallel.keys()
    for key in reference:
        # an all-reduce left out leaves rank 0 with the gradient of its half of each batch only: this fails
        torch.testing.assert_close(parallel[key], reference[key], rtol=1e-4, atol=2e-6, msg=key)


def test_only_rank_0_writes_and_the_cache_is_built_once(two_process_runs):
    tmp, a, _, _, _, _ = two_process_runs[:6]
    assert Path(a["output"]["path"]).is_file()
    assert not (tmp / "rank1-ws").exists() and not (tmp / "rank1-out.safetensors").exists()
    ranks = [json.loads((tmp / "report" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["misses"][0] > 0  # rank 0 encoded the images and captions of run A
    assert ranks[1]["misses"] == [0] * 10  # rank 1 only ever read what rank 0 had cached


def test_offloaded_quantized_two_process_run_equals_one_with_twice_the_batch(two_process_runs):
    tmp, _, _, c, _, reference = two_process_runs[:6]
    for rank in (0, 1):  # each rank parked blocks, moved them in and out, and trained on int8 layers
        placed = json.loads((tmp / "report" / f"rank{rank}.json").read_text())["placements"][3]
        assert placed["parked"] > 0 and placed["moves"] > placed["parked"] and placed["quantized"] > 0, placed
    parallel = load_file(c["output"]["path"])
    assert reference.keys() == parallel.keys()
    for key in reference:
        torch.testing.assert_close(parallel[key], reference[key], rtol=1e-4, atol=2e-6, msg=key)


def test_a_resumed_two_process_run_equals_an_uninterrupted_one(two_process_runs):
    _, a, b, _, _, _ = two_process_runs[:6]
    backups = sorted((Path(b["workspace_dir"]) / "backup").iterdir())
    assert any("step0000004" in folder.name for folder in backups)
    state = torch.load(next(f for f in backups if "step0000004" in f.name) / "state.pt", weights_only=True)
    assert len(state["ranks"]) == 2 and state["step"] == 4 and state["batch_in_epoch"] == 1
    uninterrupted, resumed = load_file(a["output"]["path"]), load_file(b["output"]["path"])
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("size, world, expected", [
    (4, 2, [([0, 1], 0, 0.5), ([2, 3], 2, 0.5)]),
    (3, 2, [([0, 1], 0, 2 / 3), ([2], 2, 1 / 3)]),
    (1, 2, [([0], 0, 1.0), ([0], 0, 0.0)]),  # nothing left for rank 1: the first sample, weight 0
])
def test_batch_shares_cover_the_global_batch_once(size, world, expected):
    assert [tuple(batch_share(list(range(size)), rank, world)) for rank in range(world)] == expected


def test_a_fused_backward_is_refused_with_several_gpus(tiny_model, tmp_path):
    from modules.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"method\.fused_backward.*false"):
        train_config(tiny_model, tmp_path, tmp_path, {"method": {"type": "fine_tune"}, "distributed": {"gpus": 2}})


def test_train_with_gpus_starts_itself_under_torchrun(tmp_path, tiny_model, shape_images, monkeypatch):
    import launch
    from modules.cli import multi_process

    calls = []
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(multi_process.subprocess, "call", lambda command: calls.append(command) or 0)
    config_file = tmp_path / "config.json"
    config_file.write_text(train_config(tiny_model, shape_images, tmp_path).model_dump_json())
    argv = ["train", "--config", str(config_file), "--gpus", "2"]
    assert launch.main(argv) == 0
    [command] = calls
    assert command[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert command[5].endswith("launch.py") and command[6:] == argv
    assert not (tmp_path / "ws").exists()  # this process only waited for torchrun's


def test_gradient_buckets_keep_one_dtype_and_a_size_limit(monkeypatch):
    from modules.trainer import distributed

    monkeypatch.setattr(distributed, "BUCKET_BYTES", 40)
    tensors = [torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(2, dtype=torch.float16), torch.zeros(20)]
    assert [[t.numel() for t in bucket] for bucket in distributed._buckets(tensors)] == [[4, 4], [4], [2], [20]]


def test_a_sharded_two_process_lora_equals_one_process_with_twice_the_batch(two_process_runs):
    tmp, _, _, _, reference, _, s, *_ = two_process_runs
    parallel = load_file(s["output"]["path"])
    assert reference.keys() == parallel.keys()
    for key in reference:
        torch.testing.assert_close(parallel[key], reference[key], rtol=1e-4, atol=2e-6, msg=key)
    for rank in (0, 1):  # each rank held about half of the unet's weights (dim 0 split, rows padded)
        local, full = json.loads((tmp / "report" / f"rank{rank}.json").read_text())["placements"][4]["unet_bytes"]
        assert 0.45 * full < local < 0.55 * full, (rank, local, full)


def test_a_sharded_run_samples_and_validates_on_every_rank_and_rank_0_writes(two_process_runs):
    tmp, *_, s, _, _, _, _ = two_process_runs
    samples = sorted(p.name for p in (Path(s["workspace_dir"]) / "samples").iterdir())
    assert samples == ["step0000003-0.png", "step0000006-0.png"]
    assert not (tmp / "s-rank1-ws").exists() and not (tmp / "s1.safetensors").exists()


def test_a_resumed_sharded_run_equals_an_uninterrupted_one(two_process_runs):
    _, a, *_, sb, _, _, _ = two_process_runs
    assert any("step0000004" in folder.name for folder in (Path(sb["workspace_dir"]) / "backup").iterdir())
    uninterrupted, resumed = load_file(a["output"]["path"]), load_file(sb["output"]["path"])
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], rtol=1e-4, atol=2e-6, msg=key)


def test_a_sharded_two_process_fine_tune_equals_one_process_with_twice_the_batch(two_process_runs):
    *_, f, _, reference = two_process_runs
    parallel = load_file(f["output"]["path"])  # the whole model, written by rank 0 from gathered weights
    assert reference.keys() == parallel.keys()
    for key in reference:  # without FSDP's divide factor 1 each rank's half would count half
        torch.testing.assert_close(parallel[key], reference[key], rtol=1e-4, atol=1e-6, msg=key)


def test_a_resumed_sharded_fine_tune_equals_an_uninterrupted_one(two_process_runs):
    *_, f, fb, _ = two_process_runs
    [folder] = [d for d in (Path(fb["workspace_dir"]) / "backup").iterdir() if "step0000002" in d.name]
    weights = load_file(folder / "adapter.safetensors")
    state = torch.load(folder / "state.pt", weights_only=True)
    # a single process's backup: whole weights and whole optimizer state
    conv = weights["fine_tune.unet.conv_in.weight"]
    assert conv.shape[0] == 32 and state["optimizer"]["state"][0]["exp_avg"].shape == conv.shape
    uninterrupted, resumed = load_file(f["output"]["path"]), load_file(fb["output"]["path"])
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], rtol=1e-5, atol=1e-7, msg=key)
