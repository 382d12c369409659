"""Streams, events and pinned host memory of the fakegpu device, with CUDA's hazards.

Every fakegpu op runs at once on the CPU, in the order the program issues it: that is the compute
(default) stream, always caught up. What CUDA leaves pending is what this file keeps pending:

- a ``non_blocking`` copy on a side stream runs only when something waits for it: that stream's
  ``synchronize()``, ``wait_stream(it)``, or an event recorded on it after the copy being waited
  on or synchronized. Until then its destination holds garbage (NaN for floats), so a forgotten
  wait gives wrong numbers instead of lucky right ones. It reads its source when it runs.
  A stream waiting (``wait_event``, ``wait_stream``) sees the copies into device memory; a copy
  into host memory lands only for the host (``synchronize``) or for a later copy that reads that
  memory on a stream ordered after it, as on CUDA, where a device-side wait tells the host nothing.
- a ``non_blocking`` copy from the device into pinned host memory on the compute stream lands
  when the host waits for that stream (its ``synchronize()``, an event, a blocking copy on it,
  ``torch.fakegpu.synchronize()``); it reads the source as it is when issued (stream order).
- a ``non_blocking`` copy from or to pageable host memory is synchronous, as on CUDA; so is every
  blocking copy, which first finishes the pending work of its stream.

Pinned host memory comes from ``empty_pinned(nbytes)`` (torch's own ``pin_memory`` needs a C++
allocator): uint8 CPU tensors, each rounded up to a power of two as torch's CUDA host allocator
does, counted in ``pinned_bytes()``; ``is_pinned`` knows them (and their views).
``record_stream`` is accepted and does nothing: a pending copy keeps its tensors alive itself.
"""

from __future__ import annotations

import itertools
import weakref

import torch

import fake_device_tensors
from fake_device_tensors import _cpu_view, _is_fake

_sequence = itertools.count(1)
_last_issued = 0  # sequence number of the newest pending copy on any stream
_with_pending: set = set()  # streams holding pending copies
_pinned: dict[int, int] = {}  # storage data_ptr -> rounded bytes of each live pinned allocation


class Stream(torch.Stream):
    """A fakegpu stream: a queue of copies that run when waited for (see the file's docstring)."""

    def __new__(cls, device=None, priority=0, **kwargs):
        return super().__new__(cls, device=fake_device_tensors._DEV0, priority=priority)

    def __init__(self, device=None, priority=0, **kwargs):
        # (sequence number, work, data_ptr of the host storage it writes or None for the device)
        self._pending: list[tuple[int, object, int | None]] = []
        self._seen: dict[Stream, int] = {}  # stream -> the newest of its marks this stream waited for

    # identity, not torch.Stream's (device, id): every fakegpu stream reports id 0
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def _enqueue(self, work, host_target: int | None = None) -> None:
        global _last_issued
        _last_issued = next(_sequence)
        self._pending.append((_last_issued, work, host_target))
        _with_pending.add(self)

    def _complete(self, upto: int | None = None, device_only: bool = False, host_target: int | None = None) -> None:
        """Run the pending copies up to `upto`: all of them (the host waits), only those into device
        memory (another stream waits: later device work sees them, the host does not), or only
        those into one host storage (a copy about to read it, ordered after them)."""
        kept = []
        for entry in self._pending:
            seq, work, target = entry
            late = upto is not None and seq > upto
            skip = (device_only and target is not None) or (host_target is not None and target != host_target)
            if late or skip:
                kept.append(entry)
            else:
                work()
        self._pending = kept
        if not kept:
            _with_pending.discard(self)

    def _order_after(self, stream: Stream, mark: int) -> None:
        """This stream waits (on the device) for `stream`'s work up to `mark`."""
        self._seen[stream] = max(self._seen.get(stream, 0), mark)
        stream._complete(mark, device_only=True)

    def synchronize(self) -> None:
        self._complete()

    def wait_stream(self, stream) -> None:
        self._order_after(stream, _last_issued)

    def wait_event(self, event) -> None:
        if event._stream is not None:
            self._order_after(event._stream, event._mark)

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return not self._pending


class Event:
    """Marks a point in a stream: a stream waiting on it sees that stream's device copies issued
    before the mark; the host (``synchronize``) sees all of them."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self._stream: Stream | None = None
        self._mark = 0

    def record(self, stream=None) -> None:
        self._stream = stream if stream is not None else current_stream()
        self._mark = _last_issued

    def wait(self, stream=None) -> None:
        (stream if stream is not None else current_stream()).wait_event(self)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream._complete(self._mark)

    def query(self) -> bool:
        return self._stream is None or not any(seq <= self._mark for seq, *_ in self._stream._pending)


def _settle_reads(host: torch.Tensor, stream: Stream) -> None:
    """A copy on `stream` reads `host`: the copies into it that `stream` is ordered after land first."""
    target = host.untyped_storage().data_ptr()
    for other in list(_with_pending):
        upto = None if other is stream else stream._seen.get(other, 0)
        if upto != 0:
            other._complete(upto, host_target=target)


_default: list[Stream] = []  # the compute stream, built on first use (after the device is named)
_current: list[Stream] = []


def default_stream(device=None) -> Stream:
    if not _default:
        _default.append(Stream())
    return _default[0]


def current_stream(device=None) -> Stream:
    return _current[-1] if _current else default_stream()


class StreamContext:
    """``with torch.fakegpu.stream(s)``: ops issued inside go to `s` (one current stream for all
    threads: autograd's device thread runs the backward while the main thread waits)."""

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        if self.stream is not None:
            _current.append(self.stream)
        return self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            _current.pop()
        return False


def synchronize(device=None) -> None:
    for stream in list(_with_pending):
        stream._complete()


# --- pinned host memory --------------------------------------------------------------------------

def empty_pinned(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked host memory (uint8), taking a power of two as torch's host allocator does."""
    rounded = 1 << max(int(nbytes) - 1, 0).bit_length()
    # zeroed: page-locking commits every page of the allocation (cudaHostAlloc), where an empty CPU tensor's
    # untouched tail would stay out of the process's resident memory that host measurements read
    buffer = torch.zeros(rounded, dtype=torch.uint8)
    storage = buffer.untyped_storage()
    _pinned[storage.data_ptr()] = rounded
    weakref.finalize(storage, _pinned.pop, storage.data_ptr(), None)
    return buffer[:nbytes]


def is_pinned(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in _pinned


def pinned_bytes() -> int:
    """Host bytes held pinned now (each allocation at its rounded size)."""
    return sum(_pinned.values())


# --- copies ------------------------------------------------------------------------------------

def _poison(cpu: torch.Tensor) -> None:
    if cpu.dtype == torch.bool:
        cpu.fill_(True)
    elif cpu.element_size() == 1:
        cpu.view(torch.uint8).fill_(0xFF)  # NaN in both float8 formats, -1 in int8
    elif cpu.dtype.is_floating_point or cpu.dtype.is_complex:
        cpu.fill_(float("nan"))
    else:
        cpu.fill_(-1)


def copy(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool, run) -> None:
    """Issue `run` (dst <- src, at least one of them on fakegpu) as CUDA would schedule it."""
    stream = current_stream()
    if not _is_fake(src):
        _settle_reads(src, stream)
    host = [t for t in (src, dst) if not _is_fake(t)]
    if not non_blocking or not all(is_pinned(t) for t in host):
        stream._complete()  # a blocking (or pageable, hence staged) copy syncs its stream first
        run()
        return
    if stream is default_stream():
        if _is_fake(dst):
            run()  # later ops of the compute stream are ordered after it: they see the data
            return
        snapshot = _cpu_view(src).clone()
        _poison(dst)
        stream._enqueue(lambda: dst.copy_(snapshot), dst.untyped_storage().data_ptr())
        return
    _poison(_cpu_view(dst) if _is_fake(dst) else dst)
    stream._enqueue(run, None if _is_fake(dst) else dst.untyped_storage().data_ptr())
