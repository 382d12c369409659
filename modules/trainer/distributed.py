"""Data parallel over torch.distributed: one process per GPU (torchrun starts them), each with the
whole model, training its share of every step's batches.

How the processes stay one run:
- Batches: the epoch order is built for the global batch (schedule.batch_size x processes, one
  bucket per batch, modules/data/shares.py), and each rank trains a contiguous share of it. Noise
  and timesteps are drawn for the global batch from the same seeded generator on every rank and
  sliced (ModelFamily.draw_share), so N processes of batch B draw exactly what one process of
  batch N x B draws.
- Gradients: averaged by an explicit all-reduce of the trained parameters' .grad once per
  optimizer step, after the accumulated backward passes and before unscaling, clipping and the
  step. Not DDP: the trained weights are adapters (or embeddings) spread over several parts that
  `family.predict` reaches in its own way, DDP would want one wrapped module whose forward is the
  step, all-reduce on every accumulated backward unless told `no_sync`, and unused-parameter
  tracking for the frozen base. One reduction per optimizer step is also what docs/distributed.md's
  traffic figures count. Each rank's loss is weighted by its share of the global batch, so the
  sum over ranks is the global batch's mean loss (an uneven last batch included).
- Decisions: rank 0 alone samples, validates, logs and saves; which actions run at a step (a
  timed action, a GUI request) and whether to stop are agreed in one small collective per step,
  so a backup (which gathers every rank's random states) is written by all ranks together.
- Parts too big for one GPU can be split across the ranks instead of held whole by each
  (`distributed.shard_parts`, FSDP2: sharding.py); their weights' gradients are FSDP's to reduce.
A single process has world 1 and does none of this: no collective, no extra work per step.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from modules.util.sharded_tensors import is_sharded
from modules.util.torch_utils import resolve_device


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes files and reports."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (it builds the caches), the others after it, reading them."""
        if self.active and not self.main:
            dist.barrier()
        yield
        if self.active and self.main:
            dist.barrier()

    def average_gradients(self, params: list[torch.nn.Parameter], loss_sum: torch.Tensor) -> float:
        """Sum the ranks' share-weighted gradients and losses; the global loss back. The tensors go
        in flat buckets of one dtype and device (one collective per bucket, not per tensor; at most
        BUCKET_BYTES extra memory). A parameter without a gradient on this rank gets zeros, so every
        rank reduces the same tensors in the same order. Sharded weights are left out: FSDP has
        reduce-scattered theirs (sharding.py)."""
        params = [param for param in params if not is_sharded(param)]
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        for bucket in _buckets([param.grad for param in params] + [loss_sum]):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            if flat.device.type != self.flag_device.type:
                # a device the backend cannot reduce on: a gradient parked off the GPU (layer
                # offloading) under NCCL, or gloo (CPU only) with a train device of another kind
                flat = flat.to(self.flag_device)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for tensor, reduced in zip(bucket, flat.split([t.numel() for t in bucket])):
                tensor.copy_(reduced.view_as(tensor))
        return float(loss_sum)

    def agree(self, stop: bool, actions: list[bool]) -> tuple[bool, list[bool]]:
        """Stop when any rank was asked to; run the actions rank 0 chose."""
        if not self.active:
            return stop, actions
        flags = torch.tensor([float(stop)] + [float(a and self.main) for a in actions], device=self.flag_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        values = [bool(v) for v in flags.tolist()]
        return values[0], values[1:]

    def gather(self, value) -> list:
        """Every rank's `value` (a picklable object), in rank order."""
        if not self.active:
            return [value]
        gathered = [None] * self.world
        dist.all_gather_object(gathered, value)
        return gathered

    def broadcast(self, value):
        """Rank 0's `value` (a picklable object), on every rank."""
        if not self.active:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @property
    def flag_device(self) -> torch.device:
        """Where the backend reduces: NCCL only CUDA tensors, gloo CPU ones."""
        return torch.device("cuda", self.local_rank) if dist.get_backend() == "nccl" else torch.device("cpu")


BUCKET_BYTES = 64 * 1024 * 1024
# how long a rank waits in a collective: the others wait at a barrier while rank 0 fills the caches
# (hours for a large data set and model) and at the next step while it samples; torch's default
# (10 minutes for NCCL, 30 for gloo) would end such a run. A crashed rank ends the run sooner:
# torchrun stops the others when one exits.
COLLECTIVE_TIMEOUT = timedelta(hours=6)


def _buckets(tensors: list[torch.Tensor]):
    """Consecutive runs of tensors of one dtype and device, each up to BUCKET_BYTES (or one tensor)."""
    bucket, size = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (tensor.dtype != bucket[0].dtype or tensor.device != bucket[0].device
                       or size + nbytes > BUCKET_BYTES):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket


def reduce_device(device: torch.device) -> torch.device:
    """Where the backend reduces a tensor kept on `device`: NCCL there (a GPU), gloo on the CPU."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def join_process_group(train_device: str) -> Ranks:
    """This process's place in the run: from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK),
    joining the process group (NCCL on CUDA, gloo on the CPU) unless the caller already has."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not (dist.is_available() and dist.is_initialized()):
        return Ranks()
    if not dist.is_initialized():
        cuda = _uses_cuda(train_device)
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    return Ranks(rank, world, int(os.environ.get("LOCAL_RANK", str(rank))))


def rank_device(train_device: str, ranks: Ranks) -> torch.device:
    """The train device of this rank: its own GPU (cuda:LOCAL_RANK) for auto or cuda; else as given."""
    if ranks.active and _uses_cuda(train_device):
        return torch.device("cuda", ranks.local_rank)
    return resolve_device(train_device)


def _uses_cuda(train_device: str) -> bool:
    if train_device == "auto":
        return torch.cuda.is_available()
    return torch.device(train_device).type == "cuda"


def leave_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
