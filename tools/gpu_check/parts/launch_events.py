"""launch.py's CLI called in this process (the imports paid once), its JSONL events read back:
what the GPU check's end-to-end parts (families, plan_vs_measured) run a user's commands through."""

from __future__ import annotations

import contextlib
import io
import json


def launch_events(argv: list[str]) -> tuple[int, list[dict]]:
    """(exit code, the events it printed) of `launch.py ARGV`; lines that are not JSON are dropped."""
    import launch

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = launch.main(argv)
    events = []
    for line in stdout.getvalue().splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return code, events


def launch_problem(code: int, events: list[dict], wanted: list[str]) -> str | None:
    """What went wrong in a run: its exit code and `error` messages, or the wanted events it lacks;
    None if nothing."""
    names = [event.get("event") for event in events]
    errors = [event.get("message") for event in events if event.get("event") == "error"]
    if code or errors:
        return f"exit {code}: {'; '.join(map(str, errors))[:400]}"
    missing = [name for name in wanted if name not in names]
    return f"no {', '.join(missing)} event" if missing else None
