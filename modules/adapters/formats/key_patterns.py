"""Each family's adapter key stems with their numbers blanked (`lora_unet_double_blocks_#_img_attn_qkv`),
kept in resources/adapter_key_patterns.json by tools/adapter_key_patterns.py from the released
architectures: which families a file's keys may name can be asked without building any of them
(~0.5 s each on meta). A stem's pattern is in its family's set by construction, so a family none of
whose patterns a file's keys have names none of its keys; tests/test_adapter_key_patterns.py keeps
the file equal to what the architectures give."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

PATTERNS_FILE = Path(__file__).resolve().parents[3] / "resources" / "adapter_key_patterns.json"
_NUMBER = re.compile(r"\d+")


def stem_pattern(stem: str) -> str:
    """The stem with each run of digits as `#`: one pattern for every block of a stack."""
    return _NUMBER.sub("#", stem)


@cache
def family_key_patterns() -> dict[str, frozenset[str]]:
    """family name -> the patterns of every stem its adapter files may use; {} where the file is missing."""
    if not PATTERNS_FILE.is_file():
        return {}
    return {name: frozenset(patterns) for name, patterns in json.loads(PATTERNS_FILE.read_text()).items()}
