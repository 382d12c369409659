"""Whether every torch name the code uses unguarded occurs in another torch's sources, read from
its wheel without installing it (any platform's wheel: macOS's CPU one of torch 2.11 is 80 MB).

    python -m tools.gpu_check.torch_names_in_wheel torch-2.11.0-cp312-cp312-macosx_11_0_arm64.whl

The names are torch_api_scan's (resolved against the torch running this). A name counts as
present when each of its parts is an identifier somewhere in the wheel's .py and .pyi files: a
weak test (a part that is a common word passes), which finds names wholly new since that
version and nothing else. The kit's torch_compat part, run on that torch, is the full check.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from pathlib import Path

from tools.gpu_check.parts.torch_compat import SCANNED
from tools.gpu_check.torch_api_scan import scan

REPO = Path(__file__).resolve().parent.parent.parent
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def wheel_identifiers(wheel: str) -> set[str]:
    names: set[str] = set()
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith("torch/") and name.endswith((".py", ".pyi")):
                names.update(IDENTIFIER.findall(archive.read(name).decode(errors="replace")))
    return names


def absent(used: set[str], known: set[str]) -> list[str]:
    """The dotted torch names of `used` with a part (after `torch.`) that is not in `known`."""
    return sorted(name for name in used if not all(part in known for part in name.split(".")[1:]))


def absent_names(wheel: str) -> list[str]:
    return absent(scan([REPO / name for name in SCANNED], REPO).names, wheel_identifiers(wheel))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("wheel")
    args = parser.parse_args()
    absent = absent_names(args.wheel)
    for name in absent:
        print(name)
    print(f"{len(absent)} name(s) used unguarded that {Path(args.wheel).name} does not have", file=sys.stderr)
    return 1 if absent else 0


if __name__ == "__main__":
    sys.exit(main())
