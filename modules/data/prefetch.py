"""Background loading: the next batches are assembled on a thread (cache reads, pixel
augmentations, stacking into pinned memory on CUDA) while the current step runs.

`BatchPrefetcher.collate` is a drop-in for `TrainDataset.collate`. The thread walks the epoch order
(a pure function of seed and epoch) from the position first asked for, into the following epochs;
a request that is not the next batch it made (a resume, a jump) restarts it there. What it hands
over is checked against the request, so the batches are exactly those of the synchronous path:
every random draw of a batch comes from its own (seed, epoch, batch index, position) stream, never
from a generator the thread and the trainer share. The device half (copies, a fresh-latent VAE call)
stays on the trainer's thread, so no kernel is launched from the loader.

A thread rather than a torch DataLoader: the work is mostly file reads and small copies that leave
the GIL, and worker processes would each need the dataset (and, for fresh latents, the images)
pickled over; a thread shares them.
"""

from __future__ import annotations

import queue
import threading
import weakref

import torch

from modules.data.dataset import Batch, TrainDataset

_POLL_S = 0.1  # how often a blocked loader thread looks whether it was stopped


class _Loader:
    """One loader thread from (epoch, position) on; items are ((epoch, position), the (epoch, position)
    after it, indices, HostBatch or error)."""

    def __init__(self, dataset: TrainDataset, epoch: int, position: int, depth: int, pin: bool):
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=_run, args=(dataset, epoch, position, pin, self.queue, self.stopped),
                                       name="batch-prefetch", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        try:
            while True:  # unblock a put waiting for room
                self.queue.get_nowait()
        except queue.Empty:
            pass
        self.thread.join()


def _run(dataset: TrainDataset, epoch: int, position: int, pin: bool, out: queue.Queue,
         stopped: threading.Event) -> None:
    # holds no reference to the prefetcher, so an abandoned prefetcher is collected and stops it
    try:
        while not stopped.is_set():
            batches = dataset.epoch_batches(epoch)
            if not batches:
                return
            while position < len(batches) and not stopped.is_set():
                indices = batches[position]
                following = (epoch, position + 1) if position + 1 < len(batches) else (epoch + 1, 0)
                _put(out, stopped, ((epoch, position), following, indices,
                                    dataset.assemble(indices, epoch, position, pin)))
                position += 1
            epoch, position = epoch + 1, 0
    except BaseException as error:  # noqa: BLE001  (raised on the trainer's thread when it asks)
        _put(out, stopped, (None, None, None, error))


def _put(out: queue.Queue, stopped: threading.Event, item: tuple) -> None:
    while not stopped.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return
        except queue.Full:
            continue


class BatchPrefetcher:
    def __init__(self, dataset: TrainDataset, depth: int):
        self.dataset = dataset
        self.depth = depth  # batches made ahead; 0: every batch is assembled when asked for
        self._loader: _Loader | None = None
        self._next: tuple[int, int] | None = None  # the (epoch, position) the loader hands over next
        self.prefetched = 0  # batches served from the loader (tests look)
        self._finalizer = None

    def collate(self, indices: list[int], device: torch.device, epoch: int = 0, batch_index: int = 0) -> Batch:
        if self.depth == 0:
            return self.dataset.collate(indices, device, epoch, batch_index)
        if self._loader is None or self._next != (epoch, batch_index):
            self._restart(epoch, batch_index, pin=device.type == "cuda")
        where, self._next, made_for, payload = self._take()
        if isinstance(payload, BaseException):
            self.close()
            raise payload
        if where != (epoch, batch_index) or made_for != list(indices):
            # not in the epoch order (a caller's own batch): made here, and the loader goes on as it was
            return self.dataset.collate(indices, device, epoch, batch_index)
        self.prefetched += 1
        return self.dataset.finish(payload, device)

    def _take(self) -> tuple:
        while True:
            try:
                return self._loader.queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._loader.thread.is_alive() and self._loader.queue.empty():
                    raise RuntimeError("the batch loader thread ended without a batch") from None

    def _restart(self, epoch: int, position: int, pin: bool) -> None:
        self.close()
        self._loader = _Loader(self.dataset, epoch, position, self.depth, pin)
        self._next = (epoch, position)
        self._finalizer = weakref.finalize(self, self._loader.stop)

    def close(self) -> None:
        """Stop the loader thread (the trainer's release; also when the prefetcher is collected)."""
        if self._finalizer is not None:
            self._finalizer()  # runs _Loader.stop once
            self._finalizer = None
        self._loader, self._next = None, None
