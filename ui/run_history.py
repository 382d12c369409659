"""What earlier runs left in their folders (`<user dir>/runs/<time>/`: config.json, events.jsonl),
read back so the loss curve and the gallery continue across a resume and after the window is
reopened. A run that resumed (backup.resume) continues the newest earlier run with the same
workspace; its curve is that run's curve up to where this one took over, then its own."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_NAME = re.compile(r"step(\d+)-(now)?(\d+)\.png$")  # modules/sampling/sampler.py names samples so
MAX_CHAIN = 50


@dataclass
class History:
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    samples: list[dict] = field(default_factory=list)  # {"path", "step", "prompt", "control_images"}


def read_events(run_dir: Path) -> list[dict]:
    events = []
    try:
        lines = (run_dir / "events.jsonl").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return events
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a log line on stdout, or a line cut by a crash
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def read_config(run_dir: Path) -> dict:
    try:
        data = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def sample_info(path: str, config: dict, event: dict | None = None) -> dict:
    """{"path", "step", "prompt", "control_images"} for a sample file, its step and prompt read from its
    name; its control images from its `sample` event (where the run said them: every prompt's, a
    "sample now" one's too), else from the config's prompt it names."""
    match = SAMPLE_NAME.search(Path(path).name)
    step = prompt = None
    controls: list[str] = []
    if match:
        step = int(match.group(1))
        prompts = (config.get("sampling") or {}).get("prompts") or []
        index = int(match.group(3))
        if match.group(2):  # "sample now" with a prompt from the editor: not one of the config's
            prompt = "(sampled now)"
        elif index < len(prompts) and isinstance(prompts[index], dict):
            prompt = prompts[index].get("prompt")
            controls = prompts[index].get("control_images") or []
    said = (event or {}).get("control_images")
    if isinstance(said, list):
        controls = said
    controls = [c for c in controls if isinstance(c, str)] if isinstance(controls, list) else []
    return {"path": path, "step": step, "prompt": prompt, "control_images": controls}


def run_dirs(runs: Path) -> list[Path]:
    """Run folders, oldest first (their names are start times)."""
    try:
        return sorted((d for d in runs.iterdir() if d.is_dir()), key=lambda d: d.name)
    except OSError:
        return []


def previous_run(run_dir: Path, config: dict) -> Path | None:
    """The newest run before `run_dir` with the same workspace: the one a resume continues."""
    earlier = [d for d in run_dirs(run_dir.parent) if d.name < run_dir.name]
    for candidate in reversed(earlier):
        if read_config(candidate).get("workspace_dir") == config.get("workspace_dir"):
            return candidate
    return None


def history(run_dir: Path, include_own: bool = True) -> History:
    """The loss curve and samples of `run_dir`, preceded by those of the runs it resumed."""
    chain = []
    current, own = run_dir, include_own
    while current is not None and len(chain) < MAX_CHAIN:
        config = read_config(current)
        if own:
            chain.append((current, config))
        own = True
        resumed = bool((config.get("backup") or {}).get("resume"))
        current = previous_run(current, config) if resumed else None
    result = History()
    for folder, config in reversed(chain):  # oldest first
        events = read_events(folder)
        losses = [(e["step"], e["loss"]) for e in events
                  if e.get("event") == "progress" and e.get("loss") is not None and "step" in e]
        if losses:
            first = losses[0][0]  # a resume retrains from its backup: later steps of the old run are replaced
            result.losses = [point for point in result.losses if point[0] < first]
            result.samples = [s for s in result.samples if s["step"] is None or s["step"] < first]
        result.losses += losses
        result.samples += [sample_info(e["path"], config, e) for e in events
                           if e.get("event") == "sample" and "path" in e]
    return result
