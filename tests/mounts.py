"""Folders that refuse writes for real: a read-only folder and a full disk, for the error tests.

Tests run as root, and root writes through permission bits, so a read-only folder is a read-only
tmpfs mount there (chmod 555 where the tests run as another user), and a full disk is a small
tmpfs filled up. Where mounting is not allowed (no CAP_SYS_ADMIN), the test is skipped.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount_tmpfs(folder: Path, size: str) -> None:
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", str(folder)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or result.returncode})")


def _free(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@contextlib.contextmanager
def read_only_folder(folder: Path, files: dict[str, bytes] | None = None) -> Iterator[Path]:
    """`folder` holding `files`, where nothing can be created, changed or removed."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        for name, data in (files or {}).items():
            (folder / name).write_bytes(data)
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    _mount_tmpfs(folder, "1m")
    try:
        for name, data in (files or {}).items():
            (folder / name).write_bytes(data)
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True, capture_output=True)
        yield folder
    finally:
        _unmount(folder)


@contextlib.contextmanager
def full_disk(folder: Path, size: str = "256k", leave_free: int = 0) -> Iterator[Path]:
    """`folder` on a small file system with no more than `leave_free` bytes left (a filler file
    takes the rest; tmpfs counts whole 4 KiB pages)."""
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a tmpfs mount (root)")
    folder.mkdir(parents=True, exist_ok=True)
    _mount_tmpfs(folder, size)
    try:
        with open(folder / ".filler", "wb", buffering=0) as filler:
            while _free(folder) > leave_free:
                try:
                    filler.write(bytes(4096))
                except OSError:  # full
                    break
        yield folder
    finally:
        _unmount(folder)
