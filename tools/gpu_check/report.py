"""report.json and report.md of a GPU check, rewritten after every part (so a run cut short by
its time limit keeps what finished)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _write(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".partial")
    temporary.write_text(text)
    os.replace(temporary, path)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/").replace("\n", " ")


class Report:
    def __init__(self, folder: Path, header: dict):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.data = {**header, "parts": []}
        self.write()

    def add(self, result: dict) -> None:
        self.data["parts"].append(result)
        self.write()

    def finish(self, **fields) -> None:
        self.data.update(fields)
        self.write()

    def write(self) -> None:
        _write(self.folder / "report.json", json.dumps(self.data, indent=2, default=str) + "\n")
        _write(self.folder / "report.md", self.markdown())

    def markdown(self) -> str:
        lines = [f"# GPU check ({self.data.get('mode')})", ""]
        for key in ("started", "device", "torch", "commit", "finished", "seconds"):
            if key in self.data:
                lines.append(f"- {key}: {self.data[key]}")
        lines += ["", "| part | status | seconds | reason |", "| --- | --- | --- | --- |"]
        for part in self.data["parts"]:
            lines.append(f"| {part['name']} | {part['status']} | {part.get('seconds', 0):.1f} | "
                         f"{_cell(part.get('reason', ''))} |")
        for part in self.data["parts"]:
            lines += ["", f"## {part['name']}: {part['status']}"]
            figures = part.get("figures") or {}
            for key, value in figures.items():
                if isinstance(value, (dict, list)):
                    value = json.dumps(value, default=str)
                lines.append(f"- {key}: {_cell(value)}")
            cases = part.get("cases") or []
            if cases:
                keys = list(dict.fromkeys(k for case in cases for k in (case.get("figures") or {})))
                lines += ["", "| " + " | ".join(["case", "status", *keys, "reason"]) + " |",
                          "|" + " --- |" * (len(keys) + 3)]
                for case in cases:
                    values = [_cell((case.get("figures") or {}).get(k, "")) for k in keys]
                    lines.append("| " + " | ".join([case["name"], case["status"], *values,
                                                     _cell(case.get("reason", ""))]) + " |")
            if part.get("error"):
                lines += ["", "```", part["error"][-3000:], "```"]
        return "\n".join(lines) + "\n"
