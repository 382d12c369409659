"""`--dist loadfile` hands out the longest test files first (by the seconds they took), not xdist's
default (the files with the most tests first).

xdist sends one whole file to one worker, most tests first: the files of one or two slow tests
(tests/test_plan_host_accuracy.py: 2 tests, ~100 s; test_readme_recipes.py: 3 tests, ~60 s) went
last, and one worker ran them while the other had nothing left (on the 21:38 UTC 2026-12-07 run's
durations: 955 s on the busier worker against 935 s this way; 2 workers). Longest first,
each file to whichever worker asks next, leaves the shortest files for the end.

The seconds: tests/file_seconds.json, made from a `--durations=0` log by
`python tests/longest_files_first.py LOG > tests/file_seconds.json`. The files it does not name
(under LISTED_FROM_S, or new since) follow, most tests first as xdist orders them; a stale figure
changes only the order, never which tests run."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

TABLE = Path(__file__).with_name("file_seconds.json")
LISTED_FROM_S = 2.0  # files faster than this are left out of the table: their order hardly matters
_DURATION = re.compile(r"^([0-9.]+)s (?:setup|call|teardown)\s+(\S+?)::")


def file_seconds(durations_log: str) -> dict[str, int]:
    """Per test file, the seconds its setups, calls and teardowns took in a `--durations=0` log."""
    seconds: Counter[str] = Counter()
    for line in durations_log.splitlines():
        match = _DURATION.match(line)
        if match:
            seconds[match.group(2)] += float(match.group(1))
    return {path: round(s) for path, s in seconds.most_common() if s >= LISTED_FROM_S}


def _load_table() -> dict[str, float]:
    try:
        return json.loads(TABLE.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise pytest.UsageError(f"{TABLE}: not JSON ({e}); remake it with `python {__file__} LOG`") from e


def longest_files_first_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    class LongestFilesFirst(LoadFileScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.expected_seconds = _load_table()

        def _order(self, scope: str) -> tuple[bool, float]:
            """Listed files before the rest, each by its seconds; the rest by their test count."""
            listed = self.expected_seconds.get(scope)
            return (True, listed) if listed is not None else (False, len(self.workqueue[scope]))

        def _assign_work_unit(self, node) -> None:
            # xdist takes the queue's first file: put the longest still waiting there
            self.workqueue.move_to_end(max(self.workqueue, key=self._order), last=False)
            super()._assign_work_unit(node)

    return LongestFilesFirst(config, log)


@pytest.hookimpl(optionalhook=True)  # (xdist's hook: pytest without xdist knows no such hook)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for the other modes
    return longest_files_first_scheduler(config, log)


if __name__ == "__main__":
    print(json.dumps(file_seconds(Path(sys.argv[1]).read_text(encoding="utf-8")), indent=1))
