"""The window appears in under 2 s from process start (issue 30, defect 11): `launch.py` with no
arguments, measured until its window is drawn, median of 3. Measured as wall-clock time from process
start, less the time the kernel kept the GUI's main thread waiting for a core (/proc/<pid>/schedstat):
on an idle machine that wait is ~0 and this is the plain wall time; on a loaded one (the suite's other
worker, several cores' worth of helpers) it takes out only what other processes took, and keeps what
the GUI itself spends, reading files and waiting on the X server included (which CPU time would not). Two things made it 3-8 s: torch
imported by the first config (its device check, each family's class), and every tab's form drawn
before the window could appear (ui/lazy_tabs.py builds a tab when it is first shown)."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT_S = 2.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def seconds_queued(pid: int) -> float:
    """Seconds the process's main thread has waited on a run queue (schedstat's second field, in ns)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def seconds_to_window(home: Path) -> dict[str, float]:
    """Seconds from process start (wall; "own": wall less run-queue wait; CPU) until the window is
    drawn and its event loop idle (the app prints "ready" from its first idle callback when DIFFTRAINER_REPORT_READY is
    set); the window is then checked visible by xdotool."""
    started = time.monotonic()
    env = {**os.environ, "DIFFTRAINER_HOME": str(home), "DIFFTRAINER_REPORT_READY": "1"}
    gui = subprocess.Popen([sys.executable, "launch.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    try:
        assert gui.stdout.readline().strip() == "ready", "the GUI exited before its window was ready"
        wall, queued, cpu = time.monotonic() - started, seconds_queued(gui.pid), cpu_seconds(gui.pid)
        found = subprocess.run(["xdotool", "search", "--onlyvisible", "--pid", str(gui.pid), "--name", "difftrainer"],
                               capture_output=True, timeout=30)
        assert found.returncode == 0, "no visible difftrainer window"
        return {"wall": round(wall, 2), "own": round(wall - queued, 2), "cpu": cpu}
    finally:
        gui.terminate()
        gui.wait(20)


def test_the_window_appears_within_two_seconds(display, tmp_path):
    if shutil.which("xdotool") is None:
        pytest.skip("needs xdotool (apt-get install xdotool)")
    if not Path("/proc/self/schedstat").exists():
        pytest.skip("reads the GUI's run-queue wait from /proc/<pid>/schedstat (Linux)")
    times = [seconds_to_window(tmp_path / f"home{i}") for i in range(3)]
    own = statistics.median(t["own"] for t in times)
    assert own < LIMIT_S, f"window ready after {own:.2f} s (median of 3 runs, in seconds: {times})"
