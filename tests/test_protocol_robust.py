"""The command reader survives anything a client sends: a bad line is named in a `warning` event
and the reader keeps reading, so a later stop still stops the run."""

from __future__ import annotations

import io
import json

from modules.trainer.commands import TrainCommands
from modules.trainer.event_protocol import JsonlEvents, read_commands

BAD_LINES = ['{"command": ["stop"]}', '{"command": {"name": "stop"}}', '{"command": 5}', 'stop', '[1, 2]',
             '"stop"', 'null', '{"command": "launch"}', '{"command": "stop"', '[' * 100_000, '1e999999',
             '{"command": "sample", "prompt": {"steps": 2}}', '{"command": "sample", "prompt": "a cat"}',
             '{"command": "stop", "prompt": {"prompt": "a cat"}}']


def test_every_malformed_line_is_a_warning_and_a_later_stop_still_stops():
    events_out = io.StringIO()
    commands = TrainCommands()
    stream = io.StringIO("\n".join(BAD_LINES) + "\n")
    read_commands(stream, commands, JsonlEvents(events_out)).join(timeout=10)
    assert not commands.stop_requested
    warnings = [json.loads(line)["message"] for line in events_out.getvalue().splitlines()]
    assert len(warnings) == len(BAD_LINES)
    assert all(w.startswith("ignored command line") for w in warnings)
    assert '{"command": ["stop"]}' in warnings[0]

    stream = io.StringIO("\n".join(BAD_LINES + ['{"command": "stop"}']) + "\n")
    thread = read_commands(stream, commands, JsonlEvents(io.StringIO()))
    thread.join(timeout=10)
    assert commands.stop_requested and not thread.is_alive()


# Through the CLI: tests/test_outputs_safety.py sends a list command and then a stop to a child run
# (the stop must still stop it before its first step).


def test_a_sample_prompt_out_of_bounds_is_a_warning_naming_the_field_and_is_not_queued():
    """Issue 26: "Sample now" with a seed of 2**70 or a 65536x65536 image passed and ended the run
    with a traceback at the next step (torch's seed overflow, an allocation failure)."""
    events_out = io.StringIO()
    commands = TrainCommands()
    lines = ['{"command": "sample", "prompt": {"prompt": "a cat", "seed": %d}}' % 2**70,
             '{"command": "sample", "prompt": {"prompt": "a cat", "width": 65536, "height": 65536}}',
             '{"command": "sample", "prompt": {"prompt": "a cat", "steps": 100000}}']
    read_commands(io.StringIO("\n".join(lines) + "\n"), commands, JsonlEvents(events_out)).join(timeout=10)
    assert commands.take_prompts() == [] and commands.take() == set()
    events = [json.loads(line) for line in events_out.getvalue().splitlines()]
    assert [e["event"] for e in events] == ["warning"] * 3
    seed, size, steps = (e["message"] for e in events)
    assert f"sample prompt.seed: must be <= 4294967295 (got {2**70})" in seed
    assert "prompt.width: must be <= 4096 (got 65536); prompt.height: must be <= 4096 (got 65536)" in size
    assert "prompt.steps: must be <= 500 (got 100000)" in steps
