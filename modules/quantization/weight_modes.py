"""The weight modes: how a part's base weights can be stored (`model.parts.<part>.weight_dtype`).

Each mode is one `WeightMode` entry, data in the style of torchao's `quantize_(model, config)`: its
name, bytes per parameter (what the precision policy budgets with), its layer factory (how an
nn.Linear becomes the mode's QuantizedLinear; None for a dense dtype, where the whole part is
simply stored in that dtype), a capability probe (does it run on this machine) and a fast-kernel
probe (does its own kernel run here, or a slower fallback). The config validation, the policy,
`capabilities.mode_support`, `replace.quantize_model_`, the streamed loader and `dtype_of` all
read this registry; a new mode is one `register_weight_mode(...)` (docs/quantization.md, "Adding a weight mode").

The probes are pure functions of a `capabilities.Capabilities` (what one device and the installed
libraries can do), so the policy can reason about any machine without having it. A probe returns
None when the mode (or its kernel) runs, else the reason in words.

This module imports no torch (layer classes are imported inside the factories, dtypes are named):
the config validates weight_dtype against it, and the config and the GUI load without torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modules.quantization.base import QuantizedLinear
    from modules.quantization.capabilities import Capabilities

# torch._scaled_mm's fp8 kernel needs Ada/Hopper (sm_89+) tensor cores; on older GPUs and other
# devices LinearW8A8 falls back to dequantizing, which works but saves no time.
SCALED_MM_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class LayerOptions:
    """The per-part options a layer factory may use (model.parts.<part>.*), and where the layer's
    storage is made (the streamed loader: the CPU, or the train device for a part kept there)."""

    nf4_double_quant: bool = True
    device: str = "cpu"

    def on(self, device: torch.device | str) -> LayerOptions:
        """The same options, the layer's storage on `device`."""
        return dataclasses.replace(self, device=str(device))


# an empty layer of the mode shaped like `linear` (in/out features, bias), storage on
# `options.device`; the weight arrives later through `quantize_weight` (so the streamed loader
# never holds a dense copy)
LayerFactory = Callable[["nn.Linear", "torch.dtype", LayerOptions], "QuantizedLinear"]
Probe = Callable[["Capabilities"], "str | None"]


@dataclass(frozen=True)
class WeightMode:
    name: str
    bytes_per_parameter: float
    capability: Probe  # None: works on this machine; else why not
    layer_factory: LayerFactory | None = None  # None: a dense dtype (`dtype`)
    dtype: str | None = None  # dense modes: the storage (and compute) dtype, a torch dtype's name
    fast_kernel: Probe | None = None  # modes with a kernel of their own: None when it runs, else why not
    how: str = ""  # how the mode runs where it works: its kernel's name where it has one
    # auto's ladder (policy.py): 0 dense, 1 8-bit, 2 4-bit, lower preference first; None: never auto
    auto_tier: int | None = None
    auto_preference: int = 0

    def __post_init__(self):
        if (self.layer_factory is None) == (self.dtype is None):
            raise ValueError(f"weight mode {self.name!r}: give a dense dtype or a layer factory, exactly one")

    @property
    def dense(self) -> bool:
        return self.layer_factory is None

    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)


_REGISTRY: dict[str, WeightMode] = {}


def register_weight_mode(mode: WeightMode) -> WeightMode:
    if mode.name == "auto":
        raise ValueError("'auto' is the policy's request, not a weight mode")
    if mode.name in _REGISTRY:
        raise ValueError(f"weight mode {mode.name!r} is already registered")
    _REGISTRY[mode.name] = mode
    return mode


def unregister_weight_mode(name: str) -> None:
    del _REGISTRY[name]


def weight_mode_names() -> list[str]:
    """Every registered mode, in registration order (dense first, then by bytes per parameter);
    "auto" is not a mode but a request (policy.py)."""
    return list(_REGISTRY)


def get_weight_mode(name: str) -> WeightMode:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown weight mode {name!r} (known: {', '.join(_REGISTRY)}, auto)") from None


def is_weight_mode(name: str) -> bool:
    return name in _REGISTRY


def dense_modes() -> list[WeightMode]:
    return [mode for mode in _REGISTRY.values() if mode.dense]


# --- live views of the registry (read it on every access) ------------------------------------------

class DenseDtypes(Mapping):
    """name -> torch dtype of every dense mode registered now."""

    def __getitem__(self, name: str) -> torch.dtype:
        mode = _REGISTRY.get(name)
        if mode is None or not mode.dense:
            raise KeyError(name)
        return mode.torch_dtype()

    def __iter__(self) -> Iterator[str]:
        return iter([mode.name for mode in dense_modes()])

    def __len__(self) -> int:
        return len(dense_modes())


class ModeNames(Sequence):
    """The names of the registered modes `select` keeps, in registration order."""

    def __init__(self, select: Callable[[WeightMode], bool]):
        self._select = select

    def _names(self) -> list[str]:
        return [mode.name for mode in _REGISTRY.values() if self._select(mode)]

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(tuple(self))


class BytesPerParameter(Mapping):
    """name -> bytes per parameter of every mode registered now."""

    def __getitem__(self, name: str) -> float:
        return _REGISTRY[name].bytes_per_parameter

    def __iter__(self) -> Iterator[str]:
        return iter(list(_REGISTRY))

    def __len__(self) -> int:
        return len(_REGISTRY)


# The registry's live views, each named for the one thing it holds (dense first, then by bytes
# per parameter): what a dense mode stores in, and the names of the dense, quantized and all modes.
DENSE_DTYPES = DenseDtypes()  # dense mode name -> its torch dtype
DENSE_MODE_NAMES = ModeNames(lambda mode: mode.dense)
QUANTIZED_MODES = ModeNames(lambda mode: not mode.dense)
ALL_MODES = ModeNames(lambda mode: True)


# --- the built-in modes ----------------------------------------------------------------------------
# Layer classes are imported inside the factories: each pulls its own library (bitsandbytes for
# nf4, torchao for int8) only when a layer is made.

def _dense(name: str, itemsize: int, auto_preference: int | None) -> WeightMode:
    def capability(caps: Capabilities) -> str | None:
        return None if name in caps.dense_dtypes else f"a {name} Linear does not run on {caps.device}"

    return WeightMode(name, float(itemsize), capability, dtype=name, how="dense",
                      auto_tier=None if auto_preference is None else 0, auto_preference=auto_preference or 0)


def _fp8_layer(linear: nn.Linear, compute_dtype: torch.dtype, options: LayerOptions) -> QuantizedLinear:
    from modules.quantization.linear_fp8 import LinearFp8
    return LinearFp8(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype,
                     device=options.device)


def _int8_layer(linear: nn.Linear, compute_dtype: torch.dtype, options: LayerOptions) -> QuantizedLinear:
    from modules.quantization.torchao_int8 import LinearInt8
    return LinearInt8(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype,
                      device=options.device)


def _w8a8_int8_layer(linear: nn.Linear, compute_dtype: torch.dtype, options: LayerOptions) -> QuantizedLinear:
    from modules.quantization.linear_w8a8 import LinearW8A8Int8
    return LinearW8A8Int8(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype,
                          device=options.device)


def _w8a8_fp8_layer(linear: nn.Linear, compute_dtype: torch.dtype, options: LayerOptions) -> QuantizedLinear:
    from modules.quantization.linear_w8a8 import LinearW8A8Fp8
    return LinearW8A8Fp8(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype,
                         device=options.device)


def _nf4_layer(linear: nn.Linear, compute_dtype: torch.dtype, options: LayerOptions) -> QuantizedLinear:
    from modules.quantization.linear_nf4 import LinearNf4
    return LinearNf4(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype,
                     device=options.device, double_quant=options.nf4_double_quant)


def _needs_float8(name: str) -> Probe:
    return lambda caps: None if caps.float8_dtypes else f"{name} needs torch.float8_e4m3fn casts on {caps.device}"


def _scaled_mm_fast(caps: Capabilities) -> str | None:
    if caps.scaled_mm and caps.cuda and (caps.compute_capability or (0, 0)) >= SCALED_MM_MIN_CAPABILITY:
        return None
    major, minor = SCALED_MM_MIN_CAPABILITY
    return f"torch._scaled_mm's fast path needs CUDA with compute capability >= {major}.{minor}"


# one byte per weight plus scales, per tensor (float8) or per output channel (~1% on small layers);
# nf4: 4 bits, plus an 8-bit absmax per 64-block and a float32 per 256 of those (double quant)
for _mode in (
    _dense("float32", 4, 1),  # auto's dense only where bfloat16 does not run
    _dense("bfloat16", 2, 0),
    # never picked by auto: without loss scaling float16's range overflows in training
    _dense("float16", 2, None),
    WeightMode("float8", 1.01, _needs_float8("float8"), _fp8_layer, how="e4m3 storage, dequantized in forward",
               auto_tier=1, auto_preference=1),
    WeightMode("int8", 1.01,
               lambda caps: None if caps.torchao_int8 else
               "int8 needs a working torchao (from torchao.quantization import quantize_, Int8WeightOnlyConfig "
               "must import and really quantize a Linear)",
               _int8_layer, how="torchao int8 weight-only", auto_tier=1, auto_preference=0),
    # works everywhere thanks to its dequantize fallback (and rounds activations: auto's last 8-bit resort)
    WeightMode("w8a8_int8", 1.01, lambda caps: None, _w8a8_int8_layer,
               fast_kernel=lambda caps: None if caps.int_mm else f"torch._int_mm does not run on {caps.device}",
               how="torch._int_mm", auto_tier=1, auto_preference=2),
    WeightMode("w8a8_fp8", 1.01, _needs_float8("w8a8_fp8"), _w8a8_fp8_layer, fast_kernel=_scaled_mm_fast,
               how="torch._scaled_mm"),
    WeightMode("nf4", 0.53,
               lambda caps: None if caps.bitsandbytes else
               "nf4 needs bitsandbytes (import and a quantize_4bit/dequantize_4bit round trip failed)",
               _nf4_layer, how="bitsandbytes nf4, dequantized in forward", auto_tier=2),
):
    register_weight_mode(_mode)
