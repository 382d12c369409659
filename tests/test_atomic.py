"""A failed write leaves the previous file as it was and no temp file behind."""

from __future__ import annotations

import pytest

from modules.util.atomic import write_text, write_with


def test_failed_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "lora.safetensors"
    write_text(target, "good")

    def crash(temp):
        temp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_with(target, crash)
    assert target.read_text() == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["lora.safetensors"]


def test_write_replaces_and_creates_folders(tmp_path):
    target = tmp_path / "a" / "b" / "config.json"
    write_text(target, "1")
    write_text(target, "2")
    assert target.read_text() == "2"
    assert [p.name for p in target.parent.iterdir()] == ["config.json"]
