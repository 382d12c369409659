"""`pytest -m cuda`: the suite's CUDA tests (skipped without CUDA), on the test files that have
them, so a test file whose imports this machine lacks (the GUI's customtkinter) is not collected."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent.parent
MARKED = re.compile(r"pytest\.mark\.cuda|marks=pytest\.mark\.cuda")


def marked_files() -> list[Path]:
    return sorted(path for path in (REPO / "tests").glob("test_*.py") if MARKED.search(path.read_text()))


def run(context) -> dict:
    files = marked_files()
    junit = context.work / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-rs",
               f"--junitxml={junit}", *map(str, files)]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=max(context.budget_s - 10, 5))
    except subprocess.TimeoutExpired as timeout:
        output = (timeout.stdout or b"")[-3000:]
        return {"status": "failed", "reason": "pytest -m cuda did not end within the part's budget",
                "error": output.decode(errors="replace") if isinstance(output, bytes) else output}
    cases = []
    if junit.exists():
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            failure = case.find("failure") if case.find("failure") is not None else case.find("error")
            skipped = case.find("skipped")
            if failure is not None:
                cases.append({"name": name, "status": "failed", "reason": (failure.get("message") or "")[:300]})
            elif skipped is not None:
                cases.append({"name": name, "status": "skipped", "reason": (skipped.get("message") or "")[:300]})
            else:
                cases.append({"name": name, "status": "passed", "figures": {"seconds": float(case.get("time", 0))}})
    counts = {status: sum(c["status"] == status for c in cases) for status in ("passed", "failed", "skipped")}
    figures = {"files": [path.name for path in files], **counts, "pytest_exit": done.returncode}
    if done.returncode not in (0, 5) or counts["failed"] or not cases:  # 5: nothing selected
        return {"status": "failed", "figures": figures, "cases": cases, "error": (done.stdout + done.stderr)[-3000:],
                "reason": f"{counts['failed']} CUDA test(s) failed (pytest exit {done.returncode})"}
    if not counts["passed"]:
        reasons = sorted({c["reason"] for c in cases})
        return {"status": "skipped", "figures": figures, "cases": cases,
                "reason": f"all {counts['skipped']} CUDA tests skipped: {'; '.join(reasons)[:200]}"}
    return {"status": "passed", "figures": figures, "cases": cases}
