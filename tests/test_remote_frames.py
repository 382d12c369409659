"""The bring-back stream of `launch.py remote` (helper.py's framing), fed to the receiver directly,
without ssh: a header that is not what the framing says is one message, and nothing is written."""

from __future__ import annotations

import io
import json
import sys
from types import SimpleNamespace

import pytest

from modules.remote import helper
from modules.remote.ssh import RemoteError, SshTarget


def _stream(*headers: object, data: bytes = b"abc") -> io.BytesIO:
    lines = b"".join((h if isinstance(h, bytes) else json.dumps(h).encode()) + b"\n" + data for h in headers)
    return io.BytesIO(lines + b'{"end": true}\n')


GOOD = {"path": "samples/a.png", "size": 3, "mtime": 1_700_000_000.5}


def test_good_frames_are_written_under_the_root(tmp_path):
    assert helper.receive_files(_stream(GOOD), str(tmp_path)) == ["samples/a.png"]
    assert (tmp_path / "samples" / "a.png").read_bytes() == b"abc"


@pytest.mark.parametrize("header, problem", [
    ({**GOOD, "path": 5}, "a file header's path is not text: 5"),
    ({"size": 3, "mtime": 1.0}, "a file header of the stream lacks path"),
    ({"path": "a.png", "mtime": 1.0}, "a file header of the stream lacks size"),
    ({"path": "a.png", "size": 3}, "a file header of the stream lacks mtime"),
    ({**GOOD, "size": "3"}, "the file header of 'samples/a.png' has size '3', not a whole number >= 0"),
    ({**GOOD, "size": -1}, "the file header of 'samples/a.png' has size -1, not a whole number >= 0"),
    ({**GOOD, "mtime": "now"}, "the file header of 'samples/a.png' has mtime 'now', not a time in seconds"),
    ({**GOOD, "mtime": 1e300}, "the file header of 'samples/a.png' has mtime 1e+300, not a time in seconds"),
    ([GOOD], "a file header of the stream is not a JSON object"),
    (b"{not json", "a file header of the stream is not JSON"),
    (b"[" * 100_000, "a file header of the stream is not JSON"),
])
def test_a_header_that_is_not_the_framing_is_one_value_error(tmp_path, header, problem):
    with pytest.raises(ValueError) as caught:
        helper.receive_files(_stream(header), str(tmp_path))
    assert str(caught.value).startswith(problem)
    assert not any(tmp_path.rglob("*"))


def test_the_client_reports_a_bad_frame_as_one_remote_error(tmp_path):
    """What the client's bring-back (`RemoteRun._pull`) makes of a box that sends such a header."""
    from modules.remote.run import RemoteRun

    frame = json.dumps({**GOOD, "path": 5})
    box = [sys.executable, "-c", f"import sys; sys.stdout.write({frame!r} + '\\n')"]
    run = RemoteRun(None, tmp_path / "ws", tmp_path / "out" / "lora.safetensors", "/box", 0, lambda text: None)
    target = SimpleNamespace(label="user@box", known_hosts=None, port=None, host="user@box",
                             helper_argv=lambda *argv: box)
    target.explain = lambda code, stderr, what: SshTarget.explain(target, code, stderr, what)
    run.target = target
    with pytest.raises(RemoteError, match=r"^user@box: bringing back \['samples'\]: a file header's path is not "
                                          r"text: 5 failed"):
        run._pull("/box/workspace", ["samples"], tmp_path / "ws")
