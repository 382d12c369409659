"""AdapterModule: the small base every adapter algorithm (LoRA/DoRA, LoHa, LoKr, OFT) builds on.

An adapter hooks the real base module's forward with a forward hook: no copy, no wrapper in the
module tree, so the tensors that get gradients are exactly the ones the optimizer holds, and
whatever later moves or casts the base module (offloading, quantization) acts on the real thing.
The base module is held outside the adapter's own module tree so that the adapter's state dict
holds only adapter tensors, under the names kohya/LyCORIS files use.

The hook is an object that survives `copy.deepcopy` as itself: a wrapper that deep-copies a block
every forward (to cast it, say) copies the block's hooks too, and a hook that were a bound method
would copy the adapter with it, so the copy would learn and the optimizer's tensors never would.

Geometry comes from `in_features`/`out_features` (or the Conv2d attributes), never from
`weight.shape` (a packed 4-bit weight has another shape), and the base weight is read only through
`unquantized_weight`, so every adapter works on dense, torchao-int8 and QuantizedLinear layers.

An algorithm is one subclass that declares, besides its math: its name (the config's
`adapter.type`), its own config (`config_class`), the tensor names it saves (`key_names`, kohya/
LyCORIS names after the layer's key stem) and their peft names, how it is built from its config
(`from_config`), and kohya's network metadata. modules/adapters/registry.py finds it; formats/
read all of this from the class, so a new algorithm is one new file (docs/adapters.md: "Adding an adapter
algorithm").
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from modules.quantization.base import is_linear, unquantized_weight
from modules.util.sharded_tensors import is_sharded

if TYPE_CHECKING:
    from modules.config.adapter_configs import AdapterConfigBase


class InertAdapter(ValueError):
    """The layer's shape leaves this algorithm nothing to learn (an OFT layout of 1-wide blocks):
    the layer is left without an adapter, and the run says so."""


class _AdapterHook:
    """The forward hook of one adapter; deep copies of the hooked module share it (see above)."""

    def __init__(self, adapter: AdapterModule):
        self.adapter = adapter

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self.adapter._forward_hook(module, args, output)

    def __deepcopy__(self, memo: dict) -> _AdapterHook:
        return self


class AdapterModule(nn.Module, ABC):
    # what the config's adapter.type, kohya/LyCORIS metadata and our error messages call this algorithm
    algorithm: ClassVar[str] = ""
    # its config: a subclass of AdapterConfigBase whose `type` is Literal[algorithm]
    config_class: ClassVar[type[AdapterConfigBase]]
    # the tensor names after the key stem in saved files that only this algorithm has (a file's
    # algorithm is told by them); `alpha` and `dora_scale` are shared, and not listed
    key_names: ClassVar[tuple[str, ...]] = ()
    # LyCORIS tensor names of this algorithm's variants that are not trained here: named when a file has them
    unsupported_keys: ClassVar[dict[str, str]] = {}
    # diffusers/peft: its names for ours where they differ, and the factors that carry the folded
    # scale (such files have no alpha; formats/diffusers.py)
    peft_names: ClassVar[dict[str, str]] = {}
    peft_scaled: ClassVar[tuple[str, ...]] = ()
    # kohya's `ss_network_args` algo name (LyCORIS's), when it differs from `algorithm`
    lycoris_algo: ClassVar[str | None] = None

    def __init__(self, name: str, base: nn.Module, dropout: float = 0.0, rank_dropout: float = 0.0,
                 module_dropout: float = 0.0):
        super().__init__()
        self.name = name  # the key stem in kohya files (lora_unet_...)
        self._base = [base]  # a list, so nn.Module does not register it as a child
        self.dropout = dropout
        self.rank_dropout = rank_dropout
        self.module_dropout = module_dropout
        self._handle = None
        # module dropout starts after the adapter's first training forward, so the first optimizer
        # step sees every adapter connected (the trainer's guard checks exactly that step)
        self._trained_once = False
        if is_linear(base):
            self.is_conv = False
            self.in_dim, self.out_dim, self.kernel_size = base.in_features, base.out_features, ()
        elif isinstance(base, nn.Conv2d):
            if base.groups != 1:
                raise TypeError(f"{name}: grouped convolutions (groups={base.groups}) take no adapter")
            self.is_conv = True
            self.in_dim, self.out_dim, self.kernel_size = base.in_channels, base.out_channels, tuple(base.kernel_size)
        else:
            raise TypeError(f"{name}: adapters support Linear and Conv2d layers, not {type(base).__name__}")

    # --- the algorithm's declarations (the registry and formats/ read these) -------------------

    @classmethod
    @abstractmethod
    def from_config(cls, config: AdapterConfigBase, part: str, name: str, module: nn.Module,
                    device: torch.device, dtype: torch.dtype, output_format: str = "kohya") -> AdapterModule:
        """The adapter for `module` (a layer of `part`) as `config` sets it, unhooked; `output_format`
        resolves what depends on the file the run writes (dora_axis 'auto')."""

    @staticmethod
    def common_options(config: AdapterConfigBase, device: torch.device, dtype: torch.dtype) -> dict:
        """The constructor keywords every algorithm takes from the shared config fields."""
        return {"dropout": config.dropout, "rank_dropout": config.rank_dropout,
                "module_dropout": config.module_dropout, "device": device, "dtype": dtype}

    @classmethod
    def network_args(cls, config: AdapterConfigBase, output_format: str) -> dict:
        """This algorithm's own entries of LyCORIS's `ss_network_args` (after algo and DoRA's)."""
        return {}

    @classmethod
    def network_metadata(cls, config: AdapterConfigBase, output_format: str = "kohya") -> dict[str, str]:
        """kohya's ss_network_* fields: LyCORIS's kohya module with `algo` and its args by default."""
        args = {"algo": cls.lycoris_algo or cls.algorithm}
        axis = config.resolved_dora_axis(output_format)
        if axis is not None:
            args.update(dora_wd=True, wd_on_output=axis == "output")
        args.update(cls.network_args(config, output_format))
        dim, alpha = cls.network_dim_alpha(config)
        return {"ss_network_module": "lycoris.kohya", "ss_network_dim": str(dim), "ss_network_alpha": str(alpha),
                "ss_network_args": json.dumps(args)}

    @classmethod
    def network_dim_alpha(cls, config: AdapterConfigBase) -> tuple:
        """ss_network_dim and ss_network_alpha: rank and alpha for the low-rank algorithms."""
        return getattr(config, "rank", 0), getattr(config, "alpha", 0)

    @classmethod
    def options_from_file(cls, config: AdapterConfigBase, layers: dict[str, dict[str, tuple[int, ...]]],
                          rank: int | None) -> dict[str, tuple[object, str]]:
        """The options of this algorithm a file's tensor shapes decide (stem -> tensor name -> shape,
        the rank the file shows or None): option -> (the value that rebuilds those shapes, a key that
        shows it), for the options whose value differs from `config`'s (formats/adopt.py)."""
        return {}

    def default_alpha(self, local: dict[str, torch.Tensor]) -> float:
        """alpha for a file that has none (kohya's rule: alpha = rank, scale 1): the rows of the
        first low-rank factor the file holds; the adapter's own alpha without one."""
        return float(self.alpha)

    def file_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a saved file holds for this adapter, by tensor name (its state dict by default)."""
        return {key: tensor.detach() for key, tensor in self.state_dict().items()}

    @classmethod
    def file_header(cls, adapters: list[AdapterModule]) -> dict[str, str]:
        """Header entries a saved file needs for these adapters (all of this algorithm) to read back."""
        return {}

    def from_file(self, local: dict[str, torch.Tensor], metadata: dict) -> dict[str, torch.Tensor]:
        """A file's tensors for this adapter (kohya names) as `load_state_dict` takes them, given the
        file's header (the inverse of `file_tensors` and `file_header`)."""
        return local

    def peft_unsupported(self) -> str | None:
        """Why this adapter cannot be written as diffusers/peft keys, or None."""
        return f"peft has no {self.algorithm} adapter; use 'kohya' or 'comfy'"

    @classmethod
    def peft_set_problem(cls, adapters: list[AdapterModule]) -> str | None:
        """Why diffusers would not rebuild these adapters (all of this algorithm) from peft keys, or None."""
        return None

    # --- geometry ----------------------------------------------------------------------------

    @property
    def base(self) -> nn.Module:
        return self._base[0]

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """The base weight's logical (dense) shape."""
        return (self.out_dim, self.in_dim, *self.kernel_size)

    @property
    def fan_in(self) -> int:
        return self.in_dim * math.prod(self.kernel_size)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def base_weight(self, device: torch.device | None = None, module: nn.Module | None = None) -> torch.Tensor:
        """The base layer's dense weight in float32 on `device` (the adapter's by default).

        A base in a sharded part (distributed.shard_parts) holds the whole weight only inside its
        block's forward, where the hook reads it; anywhere else (a merge, a DoRA norm) it holds this
        rank's slice, and is gathered whole here: a collective, which every rank must call together."""
        module = module if module is not None else self.base
        device = device if device is not None else self.device
        weight = getattr(module, "weight", None)
        if is_sharded(weight):
            return weight.detach().full_tensor().to(device=device, dtype=torch.float32)
        return unquantized_weight(module, torch.float32, device)

    def op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The base layer's operation with another weight (same stride, padding, dilation)."""
        if not self.is_conv:
            return F.linear(x, weight, bias)
        base = self.base
        return F.conv2d(x, weight, bias, base.stride, base.padding, base.dilation)

    def bias_of(self, module: nn.Module, like: torch.Tensor) -> torch.Tensor | None:
        """The module's bias shaped to broadcast over `like` (an output of the module)."""
        bias = getattr(module, "bias", None)
        if bias is None:
            return None
        bias = bias.detach().to(device=like.device, dtype=like.dtype)
        return bias.view(1, -1, 1, 1) if self.is_conv else bias

    # --- hooking -----------------------------------------------------------------------------

    @property
    def hooked(self) -> bool:
        return self._handle is not None

    def hook(self) -> None:
        if self._handle is None:
            self._handle = self.base.register_forward_hook(_AdapterHook(self))

    def unhook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _forward_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        # dropouts follow the base module's train/eval mode (the model's, not the adapter's)
        training = module.training
        if training:
            # torch.rand on the CPU generator: no device sync, and reproducible under the run's seed
            if self.module_dropout and self._trained_once and float(torch.rand(())) < self.module_dropout:
                return output
            self._trained_once = True
        return self.adapt(module, args[0], output, training)

    def adapt(self, module: nn.Module, x: torch.Tensor, output: torch.Tensor, training: bool) -> torch.Tensor:
        """The adapted output of `module` for input x, given its own output. Additive by default."""
        return output + self.delta(x, training).to(output.dtype)

    def delta(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        """What the adapter adds to the base output (the additive methods). By default the delta
        weight applied with the base layer's operation."""
        weight = self.delta_weight(training)
        out = self.op(x.to(weight.dtype), weight)
        if self.dropout and training:
            out = F.dropout(out, self.dropout)
        return out

    # --- weights -----------------------------------------------------------------------------

    @abstractmethod
    def delta_weight(self, training: bool = False) -> torch.Tensor:
        """The change to the base weight, in the base weight's logical shape, in the adapter dtype."""

    def merged_weight(self) -> torch.Tensor:
        """The dense float32 weight that, put into a plain copy of the base layer, gives the hooked
        output (without dropouts). On the adapter's device."""
        with torch.no_grad():
            return self.base_weight() + self.delta_weight().float()

    def row_dropout(self, weight: torch.Tensor, training: bool) -> torch.Tensor:
        """Rank dropout of the weight-based methods (LoHa, LoKr): drop whole output rows of the delta
        weight, rescaled so its expected value stays the same (as kohya does for LoRA's ranks)."""
        if not (self.rank_dropout and training):
            return weight
        keep = (torch.rand(weight.shape[0], device=weight.device) >= self.rank_dropout).to(weight.dtype)
        keep = keep / (1 - self.rank_dropout)
        return weight * keep.view(-1, *[1] * (weight.dim() - 1))

    def extra_repr(self) -> str:
        return f"{self.name}, hooked={self.hooked}"
