"""Damaged or hand-made input files give one message naming the file and the field, never a
traceback: a version-0 config whose keys collide, JSON nested without end, a safetensors header
whose entries are not what the format says."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from modules.config.errors import ConfigError
from modules.config.loading import read_json_file, set_override
from modules.loading.safetensors_stream import SafetensorsError, SafetensorsStream


@pytest.mark.parametrize("data, problem", [
    ({"version": 0, "model": "abc", "model_family": "sd15"}, "model: set by both 'model' and 'model_family'"),
    ({"version": 0, "model_family": "sd15", "model": "abc"}, "model: set by both 'model_family' and 'model'"),
    ({"version": 0, "base_model": "a", "model": {"base": "b"}}, "model.base: set by both 'base_model' and 'model'"),
])
def test_colliding_version_0_keys_are_one_message(tmp_path, data, problem):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as caught:
        read_json_file(path)
    assert caught.value.source == str(path)
    assert caught.value.problems == [f"{problem} of this version-0 file (version 0's keys move into the "
                                     "current layout); keep one of them"]


def test_version_0_keys_and_an_object_of_the_new_layout_merge(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"version": 0, "model_family": "sd15", "model": {"base": "b"}}))
    assert read_json_file(path)["model"] == {"family": "sd15", "base": "b"}


@pytest.mark.parametrize("depth", [150, 100_000])  # past the limit; past json's own recursion
def test_json_nested_without_end_is_one_message(tmp_path, depth):
    path = tmp_path / "deep.json"
    path.write_text('{"a": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ConfigError, match=rf"{path}: nested deeper than 100 levels"):
        read_json_file(path)
    with pytest.raises(ConfigError, match=r"--set seed: the value is nested deeper than 100 levels"):
        set_override({}, "seed=" + "[" * depth + "]" * depth)


def test_json_nested_as_deep_as_allowed_still_reads(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"a": ' + "[" * 99 + "]" * 99 + "}")
    assert read_json_file(path)["a"] is not None


def _with_header(tmp_path, edit) -> str:
    """A real safetensors file whose header `edit` changes (its data left as it was)."""
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.float16)}, str(good))
    raw = good.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    path = tmp_path / "edited.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])
    return str(path)


@pytest.mark.parametrize("edit, problem", [
    (lambda h: h["a"].update(data_offsets=["0", "24"]), r"data_offsets \['0', '24'\] is not two whole numbers >= 0"),
    (lambda h: h["a"].update(data_offsets=[0.0, 24]), r"data_offsets \[0.0, 24\] is not two whole numbers >= 0"),
    (lambda h: h["a"].update(data_offsets=[24, 0]), r"data_offsets \[24, 0\] span -24 bytes, its F32 shape \[2, 3\] needs 24"),
    (lambda h: h["a"].update(shape=[2, "3"]), r"shape \[2, '3'\] is not a list of whole numbers >= 0"),
    (lambda h: h["a"].update(shape=[-2, -3]), r"shape \[-2, -3\] is not a list of whole numbers >= 0"),
    (lambda h: h["a"].update(shape=[2, 2]), r"data_offsets \[0, 24\] span 24 bytes, its F32 shape \[2, 2\] needs 16"),
    (lambda h: h["a"].update(shape=True), r"shape True is not a list of whole numbers >= 0"),
    (lambda h: h["a"].pop("dtype"), r"lacks dtype"),
    (lambda h: h.update(a=[1, 2]), r"not a JSON object"),
])
def test_a_header_entry_that_is_not_what_the_format_says_is_one_message(tmp_path, edit, problem):
    path = _with_header(tmp_path, edit)
    with pytest.raises(SafetensorsError, match=rf"^{path}: not a safetensors file \(tensor 'a' of its header: "
                                               rf"{problem}\); a damaged or hand-edited file\?"):
        SafetensorsStream(path)


def test_overlapping_tensors_and_an_unknown_dtype_are_named(tmp_path):
    overlap = _with_header(tmp_path, lambda h: h["b"].update(data_offsets=[16, 24]))
    with pytest.raises(SafetensorsError, match=r"the bytes of tensors 'a' and 'b' overlap"):
        SafetensorsStream(overlap)
    unknown = _with_header(tmp_path, lambda h: h["a"].update(dtype="F7"))
    with pytest.raises(SafetensorsError, match=r"tensor 'a' has unsupported dtype 'F7'"):
        SafetensorsStream(unknown)
    assert set(SafetensorsStream(_with_header(tmp_path, lambda h: None)).keys()) == {"a", "b"}
