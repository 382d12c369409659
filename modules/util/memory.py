"""Process memory: make freed tensors go back to the OS, and read resident/peak memory."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys

# glibc mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for its dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX: 4 MiB * sizeof(long))
_DYNAMIC_MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt  # noqa: B018  (musl and other libcs may lack it)
    except (OSError, AttributeError):
        return None
    return libc


@contextlib.contextmanager
def freed_memory_returned_to_os():
    """While loading: serve every allocation over 1 MiB with its own mmap, so freeing it returns it
    to the OS. Usable as a decorator. Linux/glibc only; elsewhere it does nothing.

    glibc raises its mmap threshold to the size of the largest block freed so far (up to 32 MiB),
    after which a streamed load's one-tensor-at-a-time buffers come from the heap, fragment it, and
    stay resident: measured 2x the final model instead of 1x. A fixed threshold turns that off.

    Only for the load (issue 19): left on, every activation over 1 MiB of every training step was
    a fresh mmap, page-faulted and zeroed again and munmapped after the backward pass: 4x the page
    faults of a plain loop, ~20% slower steps on the CPU (and a third lower peak RSS). glibc cannot
    turn its dynamic threshold back on once it is set, so on leaving we set the values it
    converges to in a plain training process (threshold at its 32 MiB ceiling, trim at twice it):
    activations then reuse heap memory from step to step as they do without this trainer.
    """
    libc = _libc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        libc.malloc_trim(0)  # what the load freed on the heap, before the trim threshold rises for training
        libc.mallopt(_M_MMAP_THRESHOLD, _DYNAMIC_MMAP_THRESHOLD_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _DYNAMIC_MMAP_THRESHOLD_MAX)


def return_freed_heap() -> None:
    """Give the heap pages glibc holds free back to the OS now (malloc_trim; milliseconds on a large
    heap). Freed memory below the mmap threshold otherwise stays resident, counted in RSS: measured
    ~25% of a part's bytes while loading it (benchmarks/plan_host_accuracy.py). Elsewhere: nothing."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def process_memory() -> dict[str, int]:
    """Resident and peak-resident bytes of this process (Linux /proc; empty elsewhere)."""
    fields = {"VmRSS": "rss", "VmHWM": "peak_rss", "RssAnon": "rss_anon"}
    result: dict[str, int] = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in fields:
                    result[fields[key]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return result
