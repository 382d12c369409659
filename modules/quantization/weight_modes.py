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

The built-in modes are one file each in modules/quantization/modes/, imported the first time the
registry is read; each registers itself. This module and those files import no torch (layer
classes are imported inside the factories, dtypes are named): the config validates weight_dtype
against it, and the config and the GUI load without torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modules.quantization.base import QuantizedLinear
    from modules.quantization.capabilities import Capabilities

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
    # the part options (LayerOptions fields, model.parts.<part>.*) its layers read: the GUI shows
    # such an option only for a mode that reads it
    reads: tuple[str, ...] = ()

    def __post_init__(self):
        if (self.layer_factory is None) == (self.dtype is None):
            raise ValueError(f"weight mode {self.name!r}: give a dense dtype or a layer factory, exactly one")
        known = {field.name for field in dataclasses.fields(LayerOptions)} - {"device"}
        if unknown := set(self.reads) - known:
            raise ValueError(f"weight mode {self.name!r}: reads {sorted(unknown)}, not part options "
                             f"(LayerOptions: {', '.join(sorted(known))})")

    @property
    def dense(self) -> bool:
        return self.layer_factory is None

    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)


_REGISTRY: dict[str, WeightMode] = {}
_found = False
BUILTIN_PACKAGE = "modules.quantization.modes"  # one file per built-in mode, each registers itself


def _modes() -> dict[str, WeightMode]:
    """The registry, the built-in modes' files imported on first read. They are listed dense first,
    then by bytes per parameter (then by name); a mode registered later comes after them."""
    global _found
    if not _found:
        _found = True  # before importing: their register_weight_mode calls read the registry
        package = importlib.import_module(BUILTIN_PACKAGE)
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{BUILTIN_PACKAGE}.{info.name}")
        ordered = sorted(_REGISTRY.values(), key=lambda mode: (not mode.dense, -mode.bytes_per_parameter, mode.name))
        _REGISTRY.clear()
        _REGISTRY.update((mode.name, mode) for mode in ordered)
    return _REGISTRY


def register_weight_mode(mode: WeightMode) -> WeightMode:
    registry = _modes()
    if mode.name == "auto":
        raise ValueError("'auto' is the policy's request, not a weight mode")
    if mode.name in registry:
        raise ValueError(f"weight mode {mode.name!r} is already registered")
    registry[mode.name] = mode
    return mode


def unregister_weight_mode(name: str) -> None:
    del _modes()[name]


def weight_mode_names() -> list[str]:
    """Every registered mode: the built-in ones dense first, then by bytes per parameter, then any
    registered later; "auto" is not a mode but a request (policy.py)."""
    return list(_modes())


def get_weight_mode(name: str) -> WeightMode:
    try:
        return _modes()[name]
    except KeyError:
        raise ValueError(f"unknown weight mode {name!r} (known: {', '.join(_modes())}, auto)") from None


def is_weight_mode(name: str) -> bool:
    return name in _modes()


def reads_part_option(weight_dtype: str, option: str) -> bool:
    """Whether a part stored as `weight_dtype` uses its option `option` (auto: whether any mode it
    may pick does)."""
    if weight_dtype == "auto":
        return any(option in mode.reads for mode in _modes().values())
    return is_weight_mode(weight_dtype) and option in get_weight_mode(weight_dtype).reads


def dense_modes() -> list[WeightMode]:
    return [mode for mode in _modes().values() if mode.dense]


# --- live views of the registry (read it on every access) ------------------------------------------

class DenseDtypes(Mapping):
    """name -> torch dtype of every dense mode registered now."""

    def __getitem__(self, name: str) -> torch.dtype:
        mode = _modes().get(name)
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
        return [mode.name for mode in _modes().values() if self._select(mode)]

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(tuple(self))


class BytesPerParameter(Mapping):
    """name -> bytes per parameter of every mode registered now."""

    def __getitem__(self, name: str) -> float:
        return _modes()[name].bytes_per_parameter

    def __iter__(self) -> Iterator[str]:
        return iter(list(_modes()))

    def __len__(self) -> int:
        return len(_modes())


# The registry's live views, each named for the one thing it holds (dense first, then by bytes
# per parameter): what a dense mode stores in, and the names of the dense, quantized and all modes.
DENSE_DTYPES = DenseDtypes()  # dense mode name -> its torch dtype
DENSE_MODE_NAMES = ModeNames(lambda mode: mode.dense)
QUANTIZED_MODES = ModeNames(lambda mode: not mode.dense)
ALL_MODES = ModeNames(lambda mode: True)


def dense_mode(name: str, itemsize: int, auto_preference: int | None) -> WeightMode:
    """A dense dtype as a mode: the part stored (and computed) in torch's `name`; auto picks it
    (tier 0) unless `auto_preference` is None."""
    def capability(caps: Capabilities) -> str | None:
        return None if name in caps.dense_dtypes else f"a {name} Linear does not run on {caps.device}"

    return WeightMode(name, float(itemsize), capability, dtype=name, how="dense",
                      auto_tier=None if auto_preference is None else 0, auto_preference=auto_preference or 0)


def needs_float8(name: str) -> Probe:
    """The probe of a mode that casts to torch.float8_e4m3fn."""
    return lambda caps: None if caps.float8_dtypes else f"{name} needs torch.float8_e4m3fn casts on {caps.device}"
