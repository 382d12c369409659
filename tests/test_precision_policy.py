"""The base-precision policy (auto and pass-through), machine capabilities, and `launch.py info`."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from torch import nn

from modules.quantization.capabilities import (
    Capabilities,
    _probe_torchao,
    detect_capabilities,
    fast_kernel_modes,
    has_functional_torchao,
    mode_support,
    quantize_really_changes_linear,
    working_modes,
)
from modules.quantization.policy import plan_base_precision, resolve_base_precision

GiB = 2**30
SD15 = {"text_encoder": 123_060_480, "unet": 859_520_964, "vae": 83_653_863}
# a Flux-like family: two big parts (the transformer and a T5 holding ~28%), two small ones
FLUXISH = {"transformer": 11_901_408_320, "text_encoder_2": 4_762_310_656, "text_encoder": 123_060_480,
           "vae": 83_819_683}

# everything works, as on a recent GPU box
FULL = Capabilities(device="cuda:0", device_name="test GPU", cuda=True, compute_capability=(9, 0),
                    total_memory=80 * GiB, free_memory=80 * GiB, dense_dtypes=("float32", "bfloat16", "float16"),
                    float8_dtypes=True, torchao_int8=True, bitsandbytes=True, int_mm=True, scaled_mm=True)
NO_TORCHAO = dataclasses.replace(FULL, torchao_int8=False)
NO_TORCHAO_NO_FP8 = dataclasses.replace(FULL, torchao_int8=False, float8_dtypes=False, scaled_mm=False)
NO_BNB = dataclasses.replace(FULL, bitsandbytes=False)
NO_BF16 = dataclasses.replace(FULL, dense_dtypes=("float32",))


def sd15(te, unet, vae):
    return {"text_encoder": te, "unet": unet, "vae": vae}


# SD1.5 at nominal size: all bf16 is 2.13e9 bytes (fits from 2.67e9 free), unet int8 1.28e9 (from
# 1.60e9), unet nf4 0.87e9 (from 1.09e9). Text encoder (11.5%) and VAE (7.8%) are small: always dense.
POLICY_TABLE = [
    # (id, part sizes, free memory, capabilities, expected modes, fits)
    ("roomy: all bf16", SD15, 24 * GiB, FULL, sd15("bfloat16", "bfloat16", "bfloat16"), True),
    ("just fits dense", SD15, 2.7e9, FULL, sd15("bfloat16", "bfloat16", "bfloat16"), True),
    ("middle band: int8", SD15, 2 * GiB, FULL, sd15("bfloat16", "int8", "bfloat16"), True),
    ("no torchao: float8", SD15, 2 * GiB, NO_TORCHAO, sd15("bfloat16", "float8", "bfloat16"), True),
    ("no torchao, no fp8: w8a8_int8", SD15, 2 * GiB, NO_TORCHAO_NO_FP8, sd15("bfloat16", "w8a8_int8", "bfloat16"), True),
    ("low: nf4", SD15, 1.25 * GiB, FULL, sd15("bfloat16", "nf4", "bfloat16"), True),
    ("low without bitsandbytes: 8-bit, does not fit", SD15, 1.25 * GiB, NO_BNB, sd15("bfloat16", "int8", "bfloat16"), False),
    ("nothing fits: smallest", SD15, 0.5 * GiB, FULL, sd15("bfloat16", "nf4", "bfloat16"), False),
    ("no bf16 on the device: float32", SD15, 24 * GiB, NO_BF16, sd15("float32", "float32", "float32"), True),
    ("no bf16, tighter: float32 + int8", SD15, 3 * GiB, NO_BF16, sd15("float32", "int8", "float32"), True),
    # two big parts: the largest steps down first, and both reach 8-bit before either goes to nf4
    ("fluxish roomy", FLUXISH, 44e9, FULL,
     {"transformer": "bfloat16", "text_encoder_2": "bfloat16", "text_encoder": "bfloat16", "vae": "bfloat16"}, True),
    ("fluxish: transformer int8 first", FLUXISH, 28e9, FULL,
     {"transformer": "int8", "text_encoder_2": "bfloat16", "text_encoder": "bfloat16", "vae": "bfloat16"}, True),
    ("fluxish: both int8", FLUXISH, 23e9, FULL,
     {"transformer": "int8", "text_encoder_2": "int8", "text_encoder": "bfloat16", "vae": "bfloat16"}, True),
    ("fluxish: transformer nf4, t5 int8", FLUXISH, 20e9, FULL,
     {"transformer": "nf4", "text_encoder_2": "int8", "text_encoder": "bfloat16", "vae": "bfloat16"}, True),
    ("fluxish: both nf4", FLUXISH, 12e9, FULL,
     {"transformer": "nf4", "text_encoder_2": "nf4", "text_encoder": "bfloat16", "vae": "bfloat16"}, True),
    # no part holds 15%: all are fair game, largest (then first by name) first
    ("no dominant part", {f"p{i}": 10**9 for i in range(8)}, 18e9, FULL,
     {"p0": "int8", "p1": "int8", "p2": "bfloat16", "p3": "bfloat16", "p4": "bfloat16", "p5": "bfloat16",
      "p6": "bfloat16", "p7": "bfloat16"}, True),
]


@pytest.mark.parametrize("sizes, free, caps, expected, fits", [row[1:] for row in POLICY_TABLE],
                         ids=[row[0] for row in POLICY_TABLE])
def test_auto_decision_table(sizes, free, caps, expected, fits):
    plan = plan_base_precision("auto", "fam", sizes, int(free), caps)
    assert plan.modes == expected
    assert plan.fits is fits
    assert plan.budget_bytes == int(0.8 * int(free))
    assert (plan.estimated_bytes <= plan.budget_bytes) is fits
    # the flag and the warning channel agree: a plan that does not fit says so, with the numbers
    assert any("more than 80%" in w for w in plan.warnings) is (not fits)
    assert resolve_base_precision("auto", "fam", sizes, int(free), caps) == expected


def test_auto_per_part_counts_explicit_parts_against_the_budget():
    # 1.75 GiB fits bf16 small parts + an int8 unet, but with the small parts fixed at float32 only nf4 fits
    assert resolve_base_precision("auto", "sd15", SD15, int(1.75 * GiB), FULL) == sd15("bfloat16", "int8", "bfloat16")
    requested = {"text_encoder": "float32", "unet": "auto", "vae": "float32"}
    assert resolve_base_precision(requested, "sd15", SD15, int(1.75 * GiB), FULL) == sd15("float32", "nf4", "float32")
    assert resolve_base_precision(requested, "sd15", SD15, 24 * GiB, FULL) == sd15("float32", "bfloat16", "float32")
    # a small part asked for auto stays dense even when memory is tight
    assert resolve_base_precision({"unet": "nf4", "vae": "auto", "text_encoder": "auto"}, "sd15", SD15,
                                  int(0.5 * GiB), FULL) == sd15("bfloat16", "nf4", "bfloat16")


def test_auto_with_unknown_free_memory_stays_dense_and_says_so():
    plan = plan_base_precision("auto", "sd15", SD15, None, FULL)
    assert plan.modes == sd15("bfloat16", "bfloat16", "bfloat16")
    assert plan.fits is None and plan.budget_bytes is None
    assert any("free memory on cuda:0 is unknown" in w for w in plan.warnings)


@pytest.mark.parametrize("mode", working_modes(FULL))
def test_explicit_modes_that_work_pass_through_whatever_the_memory(mode):
    requested = {"text_encoder": "float32", "unet": mode, "vae": "float32"}
    assert resolve_base_precision(requested, "sd15", SD15, 1, FULL) == requested
    assert resolve_base_precision(mode, "sd15", SD15, 1, FULL) == dict.fromkeys(SD15, mode)


def test_a_mode_that_does_not_work_is_refused_with_the_dotted_path_and_why():
    caps = dataclasses.replace(FULL, torchao_int8=False, bitsandbytes=False)
    with pytest.raises(ValueError) as error:
        resolve_base_precision({"text_encoder": "nf4", "unet": "int8", "vae": "auto"}, "sd15", SD15, 24 * GiB, caps)
    message = str(error.value)
    # every bad part in one message, one line each
    assert "model.parts.unet.weight_dtype: int8 does not work on this machine: int8 needs a working torchao" in message
    assert "model.parts.text_encoder.weight_dtype: nf4 does not work on this machine: nf4 needs bitsandbytes" in message
    assert "vae" not in message
    with pytest.raises(ValueError, match=r"model\.parts\.unet\.weight_dtype: unknown mode 'int4'"):
        resolve_base_precision({"unet": "int4"}, "sd15", SD15, 24 * GiB, FULL)
    with pytest.raises(ValueError, match=r"model\.parts\.unet\.weight_dtype: float16 does not work"):
        resolve_base_precision({"unet": "float16"}, "sd15", SD15, 24 * GiB, NO_BF16)
    with pytest.raises(ValueError, match=r"model\.parts\.unet\.weight_dtype: w8a8_fp8 does not work.*float8_e4m3fn"):
        resolve_base_precision({"unet": "w8a8_fp8"}, "sd15", SD15, 24 * GiB, NO_TORCHAO_NO_FP8)


def test_auto_needs_every_part_sized():
    with pytest.raises(ValueError, match=r"model\.parts\.extra\.weight_dtype: auto needs the part's parameter count"):
        resolve_base_precision({"unet": "auto", "extra": "float32"}, "sd15", SD15, 24 * GiB, FULL)
    # without auto no size is needed: explicit modes just pass
    assert resolve_base_precision({"extra": "float32"}, "sd15", SD15, 24 * GiB, FULL) == {"extra": "float32"}


def test_w8a8_without_its_kernel_works_but_warns():
    slow = dataclasses.replace(FULL, compute_capability=(8, 6))  # Ampere: no fp8 tensor cores
    assert mode_support(slow)["w8a8_fp8"].works and mode_support(slow)["w8a8_fp8"].fast_kernel is False
    assert "w8a8_fp8" in fast_kernel_modes(FULL) and "w8a8_fp8" not in fast_kernel_modes(slow)
    plan = plan_base_precision({"unet": "w8a8_fp8"}, "sd15", SD15, 24 * GiB, slow)
    assert plan.modes == {"unet": "w8a8_fp8"}
    assert any("model.parts.unet.weight_dtype: w8a8_fp8 runs here through its dequantize fallback" in w
               for w in plan.warnings)
    no_int_mm = dataclasses.replace(FULL, int_mm=False)
    assert "w8a8_int8" in working_modes(no_int_mm) and "w8a8_int8" not in fast_kernel_modes(no_int_mm)


def test_working_modes_follow_capabilities():
    assert working_modes(FULL) == ["float32", "bfloat16", "float16", "float8", "int8", "w8a8_fp8", "w8a8_int8", "nf4"]
    bare = Capabilities(device="weird:0", device_name="weird", cuda=False, compute_capability=None, total_memory=None,
                        free_memory=None, dense_dtypes=("float32",), float8_dtypes=False, torchao_int8=False,
                        bitsandbytes=False, int_mm=False, scaled_mm=False)
    # dense float32 and W8A8 int8 (dequantize fallback) work anywhere
    assert working_modes(bare) == ["float32", "w8a8_int8"]
    assert fast_kernel_modes(bare) == []


def test_capabilities_on_this_machine_are_sane():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    caps = detect_capabilities("cpu")
    assert torch.equal(torch.rand(3), expected_next), "probing must not move the global RNG"
    assert caps.device == "cpu" and not caps.cuda and caps.compute_capability is None
    assert caps.total_memory and 0 < caps.free_memory <= caps.total_memory
    assert caps.dense_dtypes[0] == "float32"
    assert caps.float8_dtypes == hasattr(torch, "float8_e4m3fn")
    assert caps.torchao_int8 == has_functional_torchao() == _probe_torchao()
    modes = working_modes(caps)
    assert {"float32", "w8a8_int8"} <= set(modes)
    assert ("int8" in modes) == caps.torchao_int8 and ("nf4" in modes) == caps.bitsandbytes
    assert "w8a8_fp8" not in fast_kernel_modes(caps)  # the fp8 kernel is a CUDA sm_89+ thing
    assert all(isinstance(value, bool) for value in (caps.float8_dtypes, caps.torchao_int8, caps.bitsandbytes,
                                                     caps.int_mm, caps.scaled_mm))
    json.dumps(caps.as_dict())  # what `info --json` prints


def _noop_quantize(model, config):
    pass


def _same_type_copy(model, config):
    # "quantizes" into a fresh plain Parameter: new object, same type and size, nothing saved
    model.weight = nn.Parameter(model.weight.detach().clone(), requires_grad=False)


def test_a_quantize_that_changes_nothing_is_not_torchao():
    # guards the "really changes it" check: without it a no-op quantize_ passes (its output is exact)
    assert not quantize_really_changes_linear(_noop_quantize, object)
    assert not quantize_really_changes_linear(_same_type_copy, object)
    assert not quantize_really_changes_linear(_plain_tensor_copy, object)


def _plain_tensor_copy(model, config):
    # the weight becomes a plain tensor: its type changed (Parameter to Tensor) but nothing is quantized
    weight = model.weight.detach().clone()
    del model.weight
    model.weight = weight


def _halved_and_mangled(model, config):
    # really shrinks the weight (float16) and computes, but the wrong thing (all zeros)
    model.weight = nn.Parameter(torch.zeros_like(model.weight, dtype=torch.float16), requires_grad=False)
    model.forward = lambda x: nn.functional.linear(x, model.weight.float(), model.bias)


def test_a_quantize_that_shrinks_the_weight_but_computes_wrongly_is_not_torchao():
    assert not quantize_really_changes_linear(_halved_and_mangled, object)
    halved = nn.Linear(32, 32)
    _halved_and_mangled(halved, None)
    assert type(halved.weight) is nn.Parameter and halved.weight.element_size() == 2  # it did shrink


def test_real_torchao_passes_the_check():
    pytest.importorskip("torchao.quantization")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    assert quantize_really_changes_linear(quantize_, Int8WeightOnlyConfig)


def _write_stub_torchao(root):
    package = root / "torchao"
    (package / "quantization").mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '0.0.stub'\n")
    (package / "quantization" / "__init__.py").write_text(
        "class Int8WeightOnlyConfig:\n    pass\n\n"
        "def quantize_(model, config, *args, **kwargs):\n    return None  # imports cleanly, quantizes nothing\n")


def test_info_json_rejects_a_stub_torchao_and_auto_never_picks_int8(tmp_path):
    _write_stub_torchao(tmp_path / "stub")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "stub"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "launch.py"), "info", "--json", "--device", "cpu"],
                            check=False, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["train_device"]["torchao_int8"] is False
    assert info["weight_dtypes"]["int8"]["works"] is False
    assert "torchao" in info["weight_dtypes"]["int8"]["how"]
    for name, family in info["families"].items():
        assert "int8" not in family["weight_dtypes"], name
        assert "int8" not in family["recommended"]["weight_dtype"].values(), name
    # the capabilities that machine reported, at every memory size: auto never lands on int8
    reported = info["train_device"]
    caps = Capabilities(**{**reported, "dense_dtypes": tuple(reported["dense_dtypes"]), "compute_capability": None})
    for free in (64 * GiB, 2 * GiB, 1.25 * GiB, 0.1 * GiB):
        assert "int8" not in resolve_base_precision("auto", "sd15", SD15, int(free), caps).values()
    assert resolve_base_precision("auto", "sd15", SD15, 2 * GiB, caps)["unet"] == "float8"


def test_info_text_and_json_in_process(capsys):
    import launch

    assert launch.main(["info", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "train device: cpu" in text and "weight_dtype on cpu:" in text and "auto on cpu:" in text
    assert launch.main(["info", "--json", "--device", "cpu"]) == 0
    info = json.loads(capsys.readouterr().out)
    # the fields info always had stay
    assert {"torch", "devices", "families"} <= set(info)
    assert info["devices"]["cpu"]["weight_dtypes"][0] == "float32"
    sd = info["families"]["sd15"]
    assert {"label", "presets", "weight_dtypes", "recommended"} <= set(sd)
    assert set(sd["recommended"]["weight_dtype"]) == set(SD15)
    assert launch.main(["info", "--device", "no-such-device"]) == 2
    assert "--device: 'no-such-device' is not usable here" in capsys.readouterr().err
