"""The GUI's plan worker (ui/plan_worker.py) without a window or torch: children that stand in for
`launch.py plan --json` (a few lines of Python echoing the config), so what is tested is the
worker's own logic: requests made while one is planned are coalesced into the newest, a child's
error line comes back as the message, and closing kills a running child."""

from __future__ import annotations

import json
import sys
import time

from ui.plan_worker import PlanWorker

# argv[1]: the config file; a config {"sleep": s} waits s seconds, {"fail": msg} fails as the CLI does
FAKE_PLAN = """
import json, sys, time
config = json.load(open(sys.argv[1]))
time.sleep(config.get("sleep", 0))
if "fail" in config:
    print("error: " + config["fail"], file=sys.stderr)
    sys.exit(1)
print(json.dumps({"fits": True, "echo": config, "options": sys.argv[2:]}))
"""


def fake_plan(config_file, options):
    return [sys.executable, "-c", FAKE_PLAN, str(config_file), *options]


def wait_idle(worker: PlanWorker, timeout: float = 30) -> list:
    deadline, results = time.monotonic() + timeout, []
    while worker.busy and time.monotonic() < deadline:
        results += worker.drain()
        time.sleep(0.02)
    return results + worker.drain()


def test_requests_during_a_plan_are_coalesced_into_the_newest():
    worker = PlanWorker(fake_plan)
    try:
        first = worker.request(json.dumps({"sleep": 1.0, "n": 1}))
        time.sleep(0.3)  # the first child is running
        for n in (2, 3, 4):
            worker.request(json.dumps({"n": n}), ("--vram", f"{n}GiB"))
        results = wait_idle(worker)
        assert [(number, kind, payload["echo"]["n"], payload["options"]) for number, kind, payload in results] == [
            (first, "ok", 1, []), (worker.requested, "ok", 4, ["--vram", "4GiB"])]
    finally:
        worker.close()


def test_the_clis_error_line_is_the_message():
    worker = PlanWorker(fake_plan)
    try:
        worker.request(json.dumps({"fail": "model.base: /nowhere does not exist"}))
        assert wait_idle(worker) == [(1, "error", "model.base: /nowhere does not exist")]
    finally:
        worker.close()


def test_close_kills_the_running_child():
    worker = PlanWorker(fake_plan)
    worker.request(json.dumps({"sleep": 60}))
    deadline = time.monotonic() + 10
    while worker._child is None and time.monotonic() < deadline:
        time.sleep(0.02)
    child = worker._child
    assert child is not None
    started = time.monotonic()
    worker.close()
    assert child.poll() is not None and time.monotonic() - started < 10
    assert worker.drain() == []  # a killed plan reports nothing
    assert not worker._folder.exists()
