"""Per-step work of the trainer and of the bare loop, counted rather than timed.

    python -m benchmarks.step_work --model DIR --images DIR --resolution R [--batch 2] [--steps 6]

Runs the bare loop (benchmarks/bare_loop.py) and then the trainer (GenericTrainer, the benchmark's
settings) for `--steps` optimizer steps each, in this one process, and prints one JSON line with,
per implementation:

- `heavy_ops`: the aten matmul, convolution and attention calls of one whole step (forward,
  backward, optimizer), counted with a TorchDispatchMode on the last step,
- `saved_bytes`: bytes of the tensors autograd saves for the backward pass in that step
  (torch.autograd.graph.saved_tensors_hooks),
- `held_bytes`: bytes of all tensor storages alive when that step's backward pass begins (every
  tensor Python can reach, weights and optimizer state included, plus the ones autograd saved):
  what the forward pass holds, where `saved_bytes` misses a copy kept by a Python reference (a
  batch, a float32 target, a cached embedding) and counts a storage saved twice twice; the
  trainer may hold its `data.prefetch_batches` batches assembled ahead beyond the bare loop
  (`batch_bytes`: one batch's latents and text embeddings),
- `minor_faults`: the process's minor page faults per step (getrusage), on the steps between
  the two warm-up steps and the counted one (for the record: glibc's own heuristics make the bare
  loop's count vary by 3x from run to run),
- `graph_nodes_after_step`: autograd graph nodes still reachable from a tensor Python can reach
  when the counted step has ended (its optimizer step and progress report done): 0 when the step's
  graph dies with the step, as the bare loop's does. A kept graph frees its saved tensors in the
  backward pass, but its nodes and their small metadata stay where the forward pass put them,
  among the freed activations, and cut that memory up for the next step (issue 19: the trainer's
  `loss` variable kept it until the next forward pass; glibc's heap grew by ~700 MB on `small`),
- `reuse_faults`: after the steps, the minor page faults of filling and freeing blocks of
  activation size (2, 8 and 24 MiB) once more, after two rounds that let the allocator settle.
  Memory a step frees should serve the next step: 0 faults. When freed blocks go back to the OS
  instead, each is faulted in (and zeroed by the kernel) again, size / 4 KiB faults per block.
  Issue 19 was that: a glibc malloc setting of the streamed load (every block over 1 MiB its own
  mmap), left on for training, cost ~20% of every step on the CPU, with the same ops and the same
  saved bytes as the bare loop, and a third less peak RSS.

These are counts: a busy shared machine changes them little, unlike wall times. The bare loop runs
first because malloc settings are per process and the trainer's model load may change them; the bare
loop loads through diffusers/transformers, which leave glibc at its defaults.
tests/test_step_work.py runs this on the tiny model; `benchmarks.release_check` on each size.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
import resource
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
HEAVY = re.compile(r"mm|convolution|attention")  # mm, addmm, bmm, baddbmm, convolution(_backward), sdpa
WARMUP_STEPS = 2
REUSE_BLOCKS_MIB = (2, 8, 24)  # activation sizes of the benchmark's small model (the largest are ~32 MiB)


class OpCounter(TorchDispatchMode):
    """Counts ops; calls `on_backward` once, before the first op autograd's engine runs (nothing the
    forward pass made is freed yet then)."""

    def __init__(self, on_backward=lambda: None) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.on_backward = on_backward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on_backward is not None and torch._C._current_graph_task_id() != -1:
            on_backward, self.on_backward = self.on_backward, None
            on_backward()
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def live_storages() -> dict[int, int]:
    """{data pointer: bytes} of the storages of every tensor the garbage collector can reach."""
    storages = {}
    for thing in gc.get_objects():
        if isinstance(thing, torch.Tensor) and thing.device.type != "meta":
            storage = thing.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return storages


def graph_nodes_alive() -> int:
    """Autograd graph nodes reachable from the tensors the garbage collector can reach."""
    nodes, stack = {}, [t.grad_fn for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is not None and id(node) not in nodes:
            nodes[id(node)] = node  # kept, so ids stay unique while counting
            stack.extend(following for following, _ in node.next_functions)
    return len(nodes)


class StepWork:
    """Brackets steps: `begin(step)` before a step starts, `end(step)` after it ends. Counts page
    faults per measured step, and ops and saved bytes on the last one."""

    def __init__(self, steps: int) -> None:
        if steps < WARMUP_STEPS + 2:
            raise ValueError(f"--steps: at least {WARMUP_STEPS + 2} (warm-up, measured, counted)")
        self.steps = steps
        self.faults: list[int] = []
        self.saved_bytes = 0
        self.saved_storages: dict[int, int] = {}
        self.held_bytes = 0
        self.graph_nodes_after_step = 0
        self.counter = OpCounter(self._held_at_backward)
        self._open: list = []
        self._faults_at = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.saved_bytes += tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        self.saved_storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def _held_at_backward(self) -> None:
        with torch.utils._python_dispatch._disable_current_modes():  # the census's own ops are not the step's
            self.held_bytes = sum({**live_storages(), **self.saved_storages}.values())

    def begin(self, step: int) -> None:
        self._faults_at = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if step == self.steps:
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
            self._open = [hooks, self.counter]
            for context in self._open:
                context.__enter__()

    def end(self, step: int) -> None:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self._faults_at
        if WARMUP_STEPS < step < self.steps:
            self.faults.append(faults)
        for context in reversed(self._open):
            context.__exit__(None, None, None)
        self._open = []
        if step == self.steps:
            self.graph_nodes_after_step = graph_nodes_alive()

    def result(self) -> dict:
        return {
            "reuse_faults": reuse_faults(),
            "heavy_ops": dict(sorted((k, v) for k, v in self.counter.counts.items() if HEAVY.search(k))),
            "ops": sum(self.counter.counts.values()),
            "saved_bytes": self.saved_bytes,
            "held_bytes": self.held_bytes,
            "graph_nodes_after_step": self.graph_nodes_after_step,
            "minor_faults": self.faults,
            "median_minor_faults": statistics.median(self.faults),
        }


def reuse_faults(rounds: int = 3) -> int:
    """Minor page faults of the last of `rounds` rounds of filling and freeing one block of each
    REUSE_BLOCKS_MIB size (see the module docstring): 0 when freed memory is reused."""
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for mib in REUSE_BLOCKS_MIB:
            block = torch.ones(mib * 2**18)  # float32: mib MiB, every page written
            del block
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults


def bare_work(model: Path, images: Path, resolution: int, batch: int, steps: int) -> dict:
    from benchmarks.bare_loop import BareLoop

    loop, work = BareLoop(model, images, resolution, batch), StepWork(steps)
    for step, index in zip(range(1, steps + 1), loop.batches()):
        work.begin(step)
        loop.step(index).item()  # the trainer reads its loss back every step too
        work.end(step)
    return {**work.result(), "batch_bytes": loop.latents[index].nbytes + loop.hidden[index].nbytes}


def trainer_work(model: Path, images: Path, resolution: int, batch: int, steps: int) -> dict:
    from benchmarks.run import trainer_config
    from modules.config.loading import build_config
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer

    work = StepWork(steps)

    class Brackets(TrainCallbacks):
        # a step ends when its progress is reported, and the next one begins there
        def on_started(self, total_steps):
            work.begin(1)

        def on_progress(self, progress):
            work.end(progress.step)
            if progress.step < steps:
                work.begin(progress.step + 1)

    with tempfile.TemporaryDirectory(prefix="step-work-") as workspace:
        config = trainer_config(model, images, Path(workspace), steps, resolution, batch)
        # tensorboard's import and writer thread cost start-up time here and no step work
        config["tensorboard"] = False
        trainer = GenericTrainer(build_config([config]), Brackets())
        trainer.start()
        trainer.train()
    return {**work.result(), "prefetch_batches": trainer.config.data.prefetch_batches}


def measure(model: Path, images: Path, resolution: int, batch: int = 2, steps: int = 6) -> dict:
    """Both implementations in this process, bare loop first (see the module docstring)."""
    torch.manual_seed(0)
    return {"bare": bare_work(model, images, resolution, batch, steps),
            "trainer": trainer_work(model, images, resolution, batch, steps)}


def differences(work: dict, fault_slack: int = 32, held_slack: int = 4096) -> list[str]:
    """What makes the trainer's step more work than the bare loop's, as sentences (empty: none).
    Reuse faults get a slack (in pages) for whatever else the process does meanwhile; held bytes
    one (in bytes) for the trainer's scalars (step counts, learning rate, loss sum)."""
    bare, trainer = work["bare"], work["trainer"]
    problems = []
    if trainer["heavy_ops"] != bare["heavy_ops"]:
        problems.append(f"matmul/convolution/attention calls per step differ: trainer {trainer['heavy_ops']} "
                        f"vs bare loop {bare['heavy_ops']}")
    if trainer["saved_bytes"] > bare["saved_bytes"]:
        problems.append(f"tensors saved for backward: trainer {trainer['saved_bytes']} bytes vs bare loop "
                        f"{bare['saved_bytes']}")
    prefetched = trainer["prefetch_batches"] * bare["batch_bytes"]
    if trainer["held_bytes"] > bare["held_bytes"] + prefetched + held_slack:
        problems.append(f"tensors alive when the backward pass begins: trainer {trainer['held_bytes']} bytes vs bare "
                        f"loop {bare['held_bytes']} (+ {prefetched} for {trainer['prefetch_batches']} batches "
                        f"assembled ahead): the trainer's forward pass keeps something the bare loop's does not")
    if trainer["graph_nodes_after_step"] > bare["graph_nodes_after_step"]:
        problems.append(f"the step's autograd graph outlives it: {trainer['graph_nodes_after_step']} nodes reachable "
                        f"after the trainer's step vs {bare['graph_nodes_after_step']} after the bare loop's; a tensor "
                        "with a grad_fn (a loss?) is still referenced, and the graph's small objects cut the freed "
                        "activations up for the next step (issue 19)")
    if trainer["reuse_faults"] > bare["reuse_faults"] + fault_slack:
        problems.append(f"freed memory is not reused: {trainer['reuse_faults']} page faults to refill blocks of "
                        f"{'/'.join(map(str, REUSE_BLOCKS_MIB))} MiB after the trainer's steps vs {bare['reuse_faults']} "
                        "after the bare loop's; every step faults its activations in again (glibc malloc settings? "
                        "see modules/util/memory.py)")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--images", required=True, type=Path)
    parser.add_argument("--resolution", type=int, required=True)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from modules.util.library_logs import quiet_library_logs

    quiet_library_logs()
    with contextlib.redirect_stdout(sys.stderr):  # library chatter must not mix with the JSON line
        work = measure(args.model, args.images, args.resolution, args.batch, args.steps)
    work["differences"] = differences(work)
    print(json.dumps(work))


if __name__ == "__main__":
    main()
