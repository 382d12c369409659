"""docs/config.md, generated from the config's JSON Schema: every field with its dotted path,
type, default and description, so the reference is never written (or left stale) by hand.

  python -m tools.config_reference            print the reference
  python -m tools.config_reference --write    rewrite docs/config.md
  python -m tools.config_reference --check    exit 1 when docs/config.md differs from the schema

tests/test_config_reference.py runs the check, so a config change without the regenerated file fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "config.md"

HEADER = """# Config reference

Generated from the config's schema (`modules/config/train_config.py`) by
`python -m tools.config_reference --write`; do not edit by hand (tests/test_config_reference.py
fails when this file and the schema differ). `python launch.py schema` prints the same schema as
JSON. A config file, a preset and `--set key=value` all use these dotted paths; how they layer:
[presets.md](presets.md).

A section tagged by `type` (`adapter`, `optimizer`, `method`) has the fields of the chosen type
only: each type's fields are listed under it. `<part>` stands for a model part of the family
(`unet`, `transformer`, `text_encoder`, `vae`, ...: [families.md](families.md)); `[]` for each item
of a list.
"""


class Reference:
    def __init__(self, schema: dict):
        self.schema = schema
        self.defs = schema.get("$defs", {})
        # (title, note, rows of (dotted path, type, default, description))
        self.sections: list[tuple[str, str, list[tuple[str, str, str, str]]]] = []

    def resolve(self, node: dict) -> dict:
        while "$ref" in node:
            node = self.defs[node["$ref"].rsplit("/", 1)[1]]
        return node

    def type_of(self, node: dict) -> str:
        node = self.resolve(node)
        if "enum" in node:
            return " \\| ".join(f"`{json.dumps(v)}`" for v in node["enum"])
        if "const" in node:
            return f"`{json.dumps(node['const'])}`"
        for key in ("anyOf", "oneOf"):
            if key in node:
                return " or ".join(self.type_of(option) for option in node[key])
        kind = node.get("type", "any")
        if kind == "array":
            items = node.get("items")
            if isinstance(items, dict):
                return f"list of {self.type_of(items)}"
            if "prefixItems" in node:
                return "[" + ", ".join(self.type_of(i) for i in node["prefixItems"]) + "]"
            return "list"
        if kind == "object":
            return "object" if "additionalProperties" not in node or node["additionalProperties"] is False \
                else f"map of {self.type_of(node['additionalProperties'])}" \
                if isinstance(node["additionalProperties"], dict) else "object"
        bounds = []
        for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="),
                          ("exclusiveMaximum", "<")):
            if key in node:
                bounds.append(f"{sign} {node[key]}")
        return kind + (f" ({', '.join(bounds)})" if bounds else "")

    @staticmethod
    def is_object(node: dict) -> bool:
        return node.get("type") == "object" and "properties" in node

    def tagged_members(self, node: dict) -> list[tuple[str, dict]] | None:
        """A discriminated union's members, by tag value; None if `node` is not one."""
        mapping = node.get("discriminator", {}).get("mapping")
        if mapping:
            return [(tag, self.resolve({"$ref": ref})) for tag, ref in sorted(mapping.items())]
        # a oneOf of objects each with a fixed `type` (the declared unions of modules/config/tagged.py)
        members = []
        for option in node.get("oneOf", []):
            option = self.resolve(option)
            tag = self.resolve(option.get("properties", {}).get("type", {}))
            fixed = tag.get("const", (tag.get("enum") or [None, None])[0] if len(tag.get("enum", [])) == 1 else None)
            if not self.is_object(option) or fixed is None:
                return None
            members.append((fixed, option))
        return sorted(members, key=lambda member: member[0]) or None

    def walk(self, path: str, node: dict, suffix: str = "", note: str = "") -> None:
        """One table for the object at `path`; its nested objects, maps, lists of objects and tagged
        unions get their own sections, after it. `suffix` names the union member a section is in."""
        node = self.resolve(node)
        rows, nested = [], []
        for name, field in node.get("properties", {}).items():
            dotted = f"{path}.{name}" if path else name
            target = self.nested_target(field)
            if target is not None:
                nested.append((dotted, field, target))
                continue
            default = json.dumps(field["default"]) if "default" in field else ""
            rows.append((dotted, self.type_of(field), default, field.get("description", "")))
        if rows:
            title = f"`{path}`" if path else "top level"
            self.sections.append((title + suffix, note, rows))
        for dotted, field, (kind, inner) in nested:
            if kind == "union":
                for n, (tag, member) in enumerate(self.tagged_members(inner)):
                    first_note = field.get("description", "") if n == 0 else ""
                    self.walk(dotted, member, f" (type `{tag}`)", first_note)
            elif kind == "map":
                self.walk(f"{dotted}.<{dotted.rsplit('.', 1)[-1].rstrip('s') or 'key'}>", inner, suffix)
            elif kind == "list":
                self.walk(f"{dotted}[]", inner, suffix)
            else:
                self.walk(dotted, inner, suffix)

    def nested_target(self, field: dict):
        """How a field nests: ("object" | "map" | "list" | "union", the schema inside); None for a leaf."""
        node = self.resolve(field)
        if self.tagged_members(node):
            return "union", node
        if self.is_object(node):
            return "object", node
        extra = node.get("additionalProperties")
        if node.get("type") == "object" and isinstance(extra, dict) and self.is_object(self.resolve(extra)):
            return "map", self.resolve(extra)
        items = node.get("items")
        if node.get("type") == "array" and isinstance(items, dict) and self.is_object(self.resolve(items)):
            return "list", self.resolve(items)
        return None


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(schema: dict) -> str:
    reference = Reference(schema)
    reference.walk("", schema)
    out = [HEADER]
    for title, note, rows in reference.sections:
        out.append(f"\n## {title}\n")
        if note:
            out.append(cell(note) + "\n")
        out.append("| field | type | default | description |\n| --- | --- | --- | --- |")
        for dotted, kind, default, description in rows:
            shown_default = f"`{cell(default)}`" if default else ""
            out.append(f"| `{dotted}` | {kind} | {shown_default} | {cell(description)} |")
    return "\n".join(out) + "\n"


def current_schema() -> dict:
    sys.path.insert(0, str(ROOT))
    from modules.config.train_config import TrainConfig

    return TrainConfig.model_json_schema()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {REFERENCE.relative_to(ROOT)}")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    args = parser.parse_args(argv)
    text = render(current_schema())
    if args.write:
        REFERENCE.write_text(text, encoding="utf-8")
        print(f"wrote {REFERENCE.relative_to(ROOT)}")
    elif args.check:
        if not REFERENCE.is_file() or REFERENCE.read_text(encoding="utf-8") != text:
            print(f"{REFERENCE.relative_to(ROOT)} is stale: run python -m tools.config_reference --write",
                  file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
