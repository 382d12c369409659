"""Re-pack a wheel without the shared libraries a box does not load (bitsandbytes ships one per
CUDA version, ~70 MB together; a box needs one).

    python tools/gpu_check/repack_wheel.py WHEEL --keep NAME_PREFIX [--keep ...]

Every .so whose file name does not start with a --keep prefix is dropped; RECORD loses their
lines (pip reads RECORD to know what it installed). The wheel is rewritten in place.
"""

from __future__ import annotations

import argparse
import os
import zipfile
from pathlib import PurePosixPath


def repack(wheel: str, keep: list[str]) -> tuple[int, int]:
    """Drop the unkept .so files of `wheel`; return its size before and after."""
    before = os.path.getsize(wheel)
    dropped = set()
    temporary = wheel + ".partial"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(temporary, "w", zipfile.ZIP_DEFLATED) as target:
        names = source.namelist()
        for name in names:
            base = PurePosixPath(name).name
            if base.endswith(".so") and not any(base.startswith(prefix) for prefix in keep):
                dropped.add(name)
        for info in source.infolist():
            if info.filename in dropped:
                continue
            data = source.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [line for line in data.decode().splitlines() if line.split(",", 1)[0] not in dropped]
                data = ("\n".join(lines) + "\n").encode()
            target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    kept = [n for n in names if n.endswith(".so") and n not in dropped]
    if not kept:
        os.remove(temporary)
        raise SystemExit(f"error: {wheel}: no library matches {keep}; it has "
                         f"{sorted(PurePosixPath(n).name for n in dropped)}")
    os.replace(temporary, wheel)
    return before, os.path.getsize(wheel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("wheel")
    parser.add_argument("--keep", action="append", required=True, metavar="NAME_PREFIX")
    args = parser.parse_args()
    before, after = repack(args.wheel, args.keep)
    print(f"{os.path.basename(args.wheel)}: {before / 2**20:.1f} MB -> {after / 2**20:.1f} MB")


if __name__ == "__main__":
    main()
