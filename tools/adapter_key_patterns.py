"""resources/adapter_key_patterns.json: per family, the numbers-blanked stems of every adapter key its
released architecture's files may use (modules/adapters/formats/key_patterns.py says what for).

  python -m tools.adapter_key_patterns --write    rebuild every family on meta (~15 s) and rewrite the file
  python -m tools.adapter_key_patterns            say whether the file is current (exit 1 if not)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from modules.adapters.formats.file_model import model_stems  # noqa: E402
from modules.adapters.formats.key_patterns import PATTERNS_FILE, stem_pattern  # noqa: E402
from modules.config.families import family_names  # noqa: E402
from modules.config.train_config import TrainConfig  # noqa: E402
from modules.trainer.init_from_family import built_on_meta  # noqa: E402


def released_stems() -> dict[str, set[str]]:
    """family -> every adapter key stem of its released architecture, built on meta."""
    out = {}
    for name in family_names():
        built = built_on_meta(TrainConfig.model_validate({"model": {"family": name}}))
        if built is None:
            raise SystemExit(f"model.family {name!r}: its released architecture does not build on meta")
        out[name] = model_stems(built)
    return out


def patterns_of(stems: dict[str, set[str]]) -> dict[str, list[str]]:
    """family -> its sorted stem patterns."""
    return {name: sorted({stem_pattern(stem) for stem in found}) for name, found in stems.items()}


def render(patterns: dict[str, list[str]]) -> str:
    return json.dumps(patterns, indent=0) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite resources/adapter_key_patterns.json")
    args = parser.parse_args(argv)
    text = render(patterns_of(released_stems()))
    if args.write:
        PATTERNS_FILE.write_text(text)
        print(f"wrote {PATTERNS_FILE.relative_to(ROOT)}")
        return 0
    current = PATTERNS_FILE.is_file() and PATTERNS_FILE.read_text() == text
    print(f"{PATTERNS_FILE.relative_to(ROOT)}: {'current' if current else 'stale: run python -m tools.adapter_key_patterns --write'}")
    return 0 if current else 1


if __name__ == "__main__":
    sys.exit(main())
