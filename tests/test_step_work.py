"""The trainer's step does the bare loop's work and no more (issue 19), counted rather than timed.

benchmarks/step_work.py runs the bare loop and then the trainer with the same settings on the tiny
model, in a fresh process (malloc settings are per process), and counts per step: matmul,
convolution and attention calls (forward, backward and optimizer), bytes saved for the backward
pass, bytes of all tensors alive when the backward pass begins, autograd graph nodes left after the step,
and whether the memory a step frees is reused by the next one. Issue 19's slowdown had the
same ops and saved bytes as the bare loop and failed only the last: a malloc setting of the model
load made every activation over 1 MiB a fresh mmap, faulted in and zeroed again in every step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def step_work(tiny_model, shape_images) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.step_work", "--model", str(tiny_model), "--images", str(shape_images),
         "--resolution", "64", "--batch", "2", "--steps", "5"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_trainer_step_runs_the_bare_loops_matmuls_convolutions_and_attention(step_work):
    bare, trainer = step_work["bare"], step_work["trainer"]
    assert bare["heavy_ops"].get("aten.convolution_backward", 0) > 0, bare  # the count saw a whole step
    assert trainer["heavy_ops"] == bare["heavy_ops"]


def test_trainer_step_saves_no_more_for_backward_than_the_bare_loop(step_work):
    bare, trainer = step_work["bare"], step_work["trainer"]
    assert bare["saved_bytes"] > 0
    assert trainer["saved_bytes"] <= bare["saved_bytes"], (trainer["saved_bytes"], bare["saved_bytes"])


def test_trainer_forward_holds_no_more_tensors_than_the_bare_loop(step_work):
    # everything alive as the backward pass begins (weights, optimizer state, data, activations),
    # not only what autograd saved: a copy kept by a Python reference shows here; the trainer's
    # only extra is its batches assembled ahead (data.prefetch_batches), plus a few scalars
    bare, trainer = step_work["bare"], step_work["trainer"]
    assert bare["held_bytes"] > 2**20, bare  # the census ran (weights alone are more)
    allowed = bare["held_bytes"] + trainer["prefetch_batches"] * bare["batch_bytes"] + 4096
    assert trainer["held_bytes"] <= allowed, step_work["differences"]


def test_trainer_step_leaves_no_autograd_graph_behind(step_work):
    # issue 19: the trainer's `loss` variable kept the step's graph until the next forward pass
    # reassigned it; the graph's nodes, among the step's freed activations, cut that memory up for
    # the next step and the small benchmark model's heap grew by ~700 MB (peak RSS 1.05-1.10x the
    # bare loop's). Nothing is left in the bare loop: its graph dies with its step.
    bare, trainer = step_work["bare"], step_work["trainer"]
    assert bare["graph_nodes_after_step"] == 0, bare
    assert trainer["graph_nodes_after_step"] == 0, step_work["differences"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the malloc setting it guards is glibc's")
def test_memory_a_trainer_step_frees_is_reused_by_the_next_step(step_work):
    bare, trainer = step_work["bare"], step_work["trainer"]
    assert trainer["reuse_faults"] <= bare["reuse_faults"] + 32, step_work["differences"]
    assert step_work["differences"] == []
