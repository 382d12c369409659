"""Import diffusers and transformers for a process that only plans, without the libraries they
would import eagerly that a plan never uses through them.

At import, diffusers asks `importlib.util.find_spec` once whether bitsandbytes, torchao and peft
are installed and, where they are, imports them right away: its bitsandbytes and torchao
quantizers (bitsandbytes compiles its default kernels, pulling in torch._inductor), its hooks and
LoRA scaling (peft). transformers' quantizers import torchao the same way. Together 1-3 CPU
seconds of a `launch.py plan` process that the plan never needs: it builds its own quantized
layers and adapters, and imports bitsandbytes or torchao itself, when a part's weight mode runs
on them (modules/quantization/linear_nf4.py, torchao_int8.py), as peft where an adapter needs it.

So while the two libraries import, these names are `None` in `sys.modules`, the import system's
own "not installed" (`find_spec` answers None, an import raises ModuleNotFoundError); afterwards
the entries go, and the libraries import as usual for whoever asks. diffusers and transformers
then work as they do where those are not installed, which a plan does not notice. Only for
processes that plan and do nothing else (`launch.py plan`, the background plan child,
tools/preset_plans.py): one that trains, samples, quantizes or converts must never call this.
"""

from __future__ import annotations

import importlib
import sys

HIDDEN_WHILE_IMPORTING = ("bitsandbytes", "torchao", "peft")
# what decides which optional libraries diffusers and transformers use, and their model classes' bases
MODEL_LIBRARY_MODULES = ("diffusers", "diffusers.models.modeling_utils", "transformers", "transformers.modeling_utils")


def import_model_libraries_for_planning() -> None:
    """Import diffusers and transformers with HIDDEN_WHILE_IMPORTING out of their sight. Does
    nothing where either is imported already (they decided at their own import)."""
    if any(name.split(".")[0] in sys.modules for name in MODEL_LIBRARY_MODULES):
        return
    hidden = [name for name in HIDDEN_WHILE_IMPORTING if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    try:
        for name in MODEL_LIBRARY_MODULES:
            importlib.import_module(name)
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
