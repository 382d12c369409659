"""The code on the torch this machine has (on the GPU boxes 2.11, the oldest supported): every
module under modules/ imports, and every torch API the code names exists here or is guarded
(tools/gpu_check/torch_api_scan.py says what that covers)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from tools.gpu_check.torch_api_scan import scan

REPO = Path(__file__).resolve().parent.parent.parent.parent
SCANNED = ["modules", "ui", "launch.py", "benchmarks", "tools/gpu_check"]


def run(context) -> dict:
    import torch

    import modules

    failed_imports = []
    count = 0
    for info in pkgutil.walk_packages(modules.__path__, "modules."):
        count += 1
        try:
            importlib.import_module(info.name)
        except Exception as error:  # noqa: BLE001  (each failing module is a finding)
            failed_imports.append(f"{info.name}: {type(error).__name__}: {str(error)[:200]}")
    result = scan([REPO / name for name in SCANNED], REPO)
    figures = {"torch": torch.__version__, "modules_imported": count - len(failed_imports),
               "import_failures": failed_imports, "torch_api_uses": result.uses, "guarded_uses": result.guarded,
               "missing_unguarded": result.missing, "missing_but_guarded": result.guarded_missing}
    problems = len(failed_imports) + len(result.missing)
    if problems:
        return {"status": "failed", "figures": figures,
                "reason": f"{len(failed_imports)} module(s) fail to import, {len(result.missing)} torch API use(s) "
                          f"this torch {torch.__version__} lacks, unguarded"}
    return {"status": "passed", "figures": figures}
