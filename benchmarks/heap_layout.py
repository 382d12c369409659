"""glibc's main heap after each training step: how much of it is free, and how the free part is cut up.

    python -m benchmarks.heap_layout [--work DIR] [--size small] [--steps 4] [--region-mb 128]

Runs `benchmarks.run`'s trainer config in this process and, after every step, prints the process's
resident and peak-resident memory, `mallinfo2()` (heap bytes, in use, free, mmapped, releasable
top) and a walk of the main arena's chunks ([heap] in /proc/self/maps): per region of the heap, the
bytes in use, the number of chunks in use, and the largest free chunk. Linux/glibc only (reads
chunk headers in place; chunks in glibc's per-thread cache and fast bins count as in use).

Written for issue 19: on `small` the trainer's heap grew to ~2.5 GB in step 2 where the bare loop's
stayed at ~1.8-2.1 GB, with the same bytes in use between steps (~250 MB); the table showed the
free 2.2 GB cut into pieces of at most tens of MB by a few hundred small live chunks per region:
the nodes of the step's autograd graph, which the trainer kept until the next forward pass
(fixed at 138d817; benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import sys
from pathlib import Path

from benchmarks.models import SIZES
from benchmarks.run import prepare, trainer_config


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_bounds() -> tuple[int, int]:
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("[heap]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            return start, end
    raise RuntimeError("no [heap] mapping in /proc/self/maps")


def walk_chunks() -> list[tuple[int, int, bool]]:
    """(offset in the heap, size, in use) of every chunk of the main arena, the top chunk last.
    A chunk is in use when the next chunk's PREV_INUSE bit says so (glibc's own test)."""
    start, end = heap_bounds()
    word = lambda address: ctypes.c_size_t.from_address(address).value  # noqa: E731
    chunks, at = [], start
    while at + 16 <= end:
        size = word(at + 8) & ~7  # the low bits are flags
        if size == 0 or at + size + 16 > end:
            chunks.append((at - start, end - at, False))
            break
        chunks.append((at - start, size, bool(word(at + size + 8) & 1)))
        at += size
    return chunks


def memory_lines(label: str, region_mb: int) -> list[str]:
    status = {k: int(v.split()[0]) >> 10 for k, _, v in
              (line.partition(":") for line in Path("/proc/self/status").read_text().splitlines())
              if k in ("VmRSS", "VmHWM")}
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    lines = [f"{label}: RSS {status['VmRSS']} MB, peak {status['VmHWM']} MB; malloc: heap {info.arena >> 20} MB, "
             f"in use {info.uordblks >> 20} MB, free {info.fordblks >> 20} MB, mmapped {info.hblkhd >> 20} MB, "
             f"releasable top {info.keepcost >> 20} MB"]
    regions: dict[int, list[int]] = {}
    for offset, size, in_use in walk_chunks():
        region = regions.setdefault(offset // (region_mb << 20), [0, 0, 0])
        if in_use:
            region[0] += size
            region[1] += 1
        else:
            region[2] = max(region[2], size)
    lines.append(f"  {'region MB':>10} {'in use MB':>10} {'chunks':>8} {'largest free MB':>16}")
    for index in sorted(regions):
        used, count, largest = regions[index]
        lines.append(f"  {index * region_mb:>10} {used / 2**20:>10.1f} {count:>8} {largest / 2**20:>16.1f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/trainer-bench"))
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--region-mb", type=int, default=128)
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        sys.exit("heap_layout reads glibc's heap through /proc: Linux only")
    model, images = prepare(args.size, args.work.resolve())
    workspace = args.work.resolve() / args.size / "heap-layout-workspace"
    shutil.rmtree(workspace, ignore_errors=True)
    spec = SIZES[args.size]
    config_file = args.work.resolve() / args.size / "heap-layout.json"
    config_file.write_text(json.dumps(trainer_config(model, images, workspace, args.steps, spec["resolution"],
                                                     spec["batch"])))

    import launch
    from modules.trainer.generic_trainer import GenericTrainer

    report = GenericTrainer._report

    def report_with_heap(trainer, *rest):  # after each step's optimizer step and zero_grad
        report(trainer, *rest)
        print("\n".join(memory_lines(f"after step {trainer.step}", args.region_mb)), file=sys.stderr, flush=True)

    GenericTrainer._report = report_with_heap
    sys.exit(launch.main(["train", "--config", str(config_file)]))


if __name__ == "__main__":
    main()
