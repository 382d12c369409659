"""The loadfile scheduler (tests/longest_files_first.py) hands out the longest files first, and the
seconds table is read off a `--durations=0` log."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("xdist")

import longest_files_first  # noqa: E402


class _Node:
    """What the scheduler asks of a worker: the test indexes it is sent."""

    shutting_down = False

    def __init__(self, name):
        self.gateway = SimpleNamespace(id=name)  # (named when xdist compares the workers' collections)
        self.sent: list[int] = []

    def send_runtest_some(self, indexes):
        self.sent.extend(indexes)

    def shutdown(self):
        self.shutting_down = True


def _config():
    option = SimpleNamespace(tx=["2*popen"], dist="loadfile", loadscopereorder=True)
    return SimpleNamespace(option=option, getvalue=lambda name: getattr(option, name))


def test_the_longest_files_go_first_whatever_their_test_count(monkeypatch):
    # many.py has the most tests (xdist's default would send it first); slow.py is listed longest,
    # quick.py is listed and short, but its seconds are known: it goes before the unlisted ones
    monkeypatch.setattr(longest_files_first, "_load_table",
                        lambda: {"tests/slow.py": 90, "tests/mid.py": 30, "tests/quick.py": 2})
    collection = [*(f"tests/many.py::t{i}" for i in range(20)), "tests/slow.py::a", "tests/slow.py::b",
                  *(f"tests/mid.py::t{i}" for i in range(3)), "tests/unlisted.py::a", "tests/quick.py::a"]
    scheduler = longest_files_first.pytest_xdist_make_scheduler(_config(), None)
    nodes = [_Node("gw0"), _Node("gw1")]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, collection)
    scheduler.schedule()

    first_files = [collection[node.sent[0]].split("::")[0] for node in nodes]
    assert first_files == ["tests/slow.py", "tests/mid.py"]
    # gw0 holds 2 tests, so it is sent its next file at once (xdist's low-watermark); gw1 holds 3
    assert list(scheduler.assigned_work[nodes[0]]) == ["tests/slow.py", "tests/quick.py"]
    scheduler._assign_work_unit(nodes[1])  # as when gw1 runs low
    assert list(scheduler.assigned_work[nodes[1]]) == ["tests/mid.py", "tests/many.py"]
    assert list(scheduler.workqueue) == ["tests/unlisted.py"]


def test_other_dist_modes_keep_xdists_scheduler():
    config = _config()
    config.option.dist = "load"
    assert longest_files_first.pytest_xdist_make_scheduler(config, None) is None


def test_the_table_sums_each_files_setups_calls_and_teardowns():
    log = "\n".join([
        "============================== slowest durations ===============================",
        "3.00s setup    tests/test_a.py::test_one",
        "1.50s call     tests/test_a.py::test_one[x-1]",
        "0.50s teardown tests/test_a.py::test_two",
        "1.00s call     tests/test_b.py::test_quick",  # under LISTED_FROM_S: left out
        "9.00s call     tests/test_c.py::Cls::test_method",
        "(6777 durations < 0.005s hidden.  Use -vv to show these durations.)",
    ])
    assert longest_files_first.file_seconds(log) == {"tests/test_c.py": 9, "tests/test_a.py": 5}


def test_a_broken_table_names_the_file(tmp_path, monkeypatch):
    broken = tmp_path / "file_seconds.json"
    broken.write_text("{not json", encoding="utf-8")
    monkeypatch.setattr(longest_files_first, "TABLE", broken)
    with pytest.raises(pytest.UsageError, match="file_seconds.json: not JSON"):
        longest_files_first._load_table()
