"""Silence import-time chatter of the quantization libraries (a run's log is for the run).

torchao logs every optional CUDA extension it cannot load on this build, bitsandbytes every
optional CPU kernel package that is not installed, diffusers a torchao version note, and torch
a deprecation of torchao's pytree registration. None of it is actionable for a user; what does
matter (a mode that cannot work here) is probed and reported by modules/quantization/capabilities.py.
"""

from __future__ import annotations

import logging

_CHATTY = ("torchao", "bitsandbytes", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer")


def quiet_library_logs() -> None:
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.ERROR)
