"""The project's rule: memory claims come from its own plan or measurement, never by hand. A preset's
planned peak belongs in README's generated preset table (tools/preset_plans.py, from
resources/preset_plans.json); a doc that writes "planned 7.9 GiB of 8" goes stale with the next
re-plan (docs/families.md said so of FIBO Edit long after the plan said 6.9). Measured benchmark
figures, with their command and date, live in benchmarks/README.md, which this does not read."""

from __future__ import annotations

import math
import re
from pathlib import Path

from modules.model.sd15 import SD15Family
from modules.quantization.capabilities import Capabilities
from modules.quantization.policy import HEADROOM, plan_base_precision

REPO = Path(__file__).resolve().parents[1]
# "planned 5.8 GiB", "plans 21.4 GiB", "7.9 GiB of 8": a plan's figure against a tier
PLAN_FIGURE = re.compile(r"\b(?:plans?|planned) ~?\d+(?:\.\d+)? ?GiB|\d+(?:\.\d+)? GiB of (?:6|8|12|16|24|48)\b")
# "2.54 GB", "~31 GB", "10.1 GiB": a real model's size or memory, in the docs that state sizes; not a
# preset's tier ("24GB"), a goal ("8 GiB") or a link's bandwidth ("~25 GB/s")
MODEL_SIZE = re.compile(r"(?:~\d+(?:\.\d+)?|\b\d+\.\d+) ?Gi?B\b(?!/s)")
MEMORY_DOCS = ("memory-and-offload.md", "distributed.md", "families.md", "quantization.md", "gui.md")
GENERATED = re.compile(r"<!-- BEGIN (?P<name>[\w-]+).*?<!-- END (?P=name) -->", re.S)


def hand_written(path: Path, pattern: re.Pattern = PLAN_FIGURE) -> list[str]:
    # (a generated section blanked to its newlines: the line numbers stay the file's)
    text = GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(REPO)}:{n}: {m.group(0)}" for n, line in enumerate(text.splitlines(), 1)
            for m in pattern.finditer(line)]


def test_docs_point_to_the_generated_table_instead_of_writing_plan_figures():
    found = [hit for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))] for hit in hand_written(path)]
    assert not found, "planned figures written by hand (point to README's preset table instead):\n" + "\n".join(found)


def test_the_memory_docs_point_to_the_plan_or_the_benchmarks_instead_of_writing_model_sizes():
    """Sizes of real models' parts (parked bytes, activations) are the plan's (`launch.py plan`) or a
    benchmark's (benchmarks/README.md, with its command); copied into a doc they go stale."""
    found = [hit for name in MEMORY_DOCS for hit in hand_written(REPO / "docs" / name, MODEL_SIZE)]
    assert not found, "model sizes written by hand (point to the plan or benchmarks/README.md):\n" + "\n".join(found)


# a machine where every weight mode works: auto's whole ladder (bf16, int8, nf4) is open
EVERY_MODE = Capabilities(device="cuda:0", device_name="any GPU", cuda=True, compute_capability=(9, 0),
                          total_memory=None, free_memory=None, dense_dtypes=("float32", "bfloat16", "float16"),
                          float8_dtypes=True, torchao_int8=True, bitsandbytes=True, int_mm=True, scaled_mm=True)


def sd15_auto_thresholds() -> str:
    """The least free memory at which the precision policy stores SD1.5's UNet in each mode of its
    ladder (the other parts dense), as docs/quantization.md says it."""
    sizes = SD15Family.nominal_part_parameters
    least = {}
    for unet in ("bfloat16", "int8", "nf4"):
        needed = plan_base_precision({**dict.fromkeys(sizes, "bfloat16"), "unet": unet}, "sd15", sizes, None,
                                     EVERY_MODE).estimated_bytes
        free = math.ceil(needed / HEADROOM)
        at, below = (plan_base_precision("auto", "sd15", sizes, memory, EVERY_MODE) for memory in (free, free - 2**20))
        # 1 MiB less: the next rung down, or for the last one "does not fit"
        assert at.modes["unet"] == unet and at.fits and (below.modes["unet"], below.fits) != (unet, True), (
            f"auto picks {at.modes['unet']} at {free} bytes free, {below.modes['unet']} 1 MiB below")
        least[unet] = f"{free / 2**30:.2f} GiB"
    return (f"all bf16 from {least['bfloat16']} free, an int8 UNet from {least['int8']}, "
            f"an nf4 UNet from {least['nf4']}.")


def test_the_sd15_auto_thresholds_in_the_quantization_doc_are_the_policys():
    text = (REPO / "docs" / "quantization.md").read_text(encoding="utf-8")
    section = re.search(r"<!-- BEGIN sd15-auto-thresholds.*?-->\n(.*?)\n<!-- END sd15-auto-thresholds -->", text, re.S)
    assert section, "docs/quantization.md: the sd15-auto-thresholds section is gone"
    assert section.group(1) == sd15_auto_thresholds(), (
        "docs/quantization.md: the sd15-auto-thresholds section is not the policy's; write:\n" + sd15_auto_thresholds())
