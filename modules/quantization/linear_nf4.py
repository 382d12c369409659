"""LinearNf4: 4-bit NormalFloat weight on bitsandbytes (weight_dtype "nf4").

bitsandbytes' `quantize_4bit` returns packed codes and a QuantState holding tensors (absmax, the code
table, and with double quantization the quantized absmax's own absmax, code table and offset). Here
each of those tensors is a registered buffer and the QuantState is rebuilt from the buffers at every
dequantize: a QuantState kept as an attribute would hold tensors that `Module.to()`,
`load_state_dict()` and the offloader never see. Blocksize, shape and dtype are plain values.

bitsandbytes is imported inside the methods: importing this module stays cheap and works without it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from modules.quantization.base import QuantizedLinear

BLOCKSIZE = 64
# the blocksize bitsandbytes' quantize_4bit uses for the absmax of the absmax (compress_statistics)
NESTED_BLOCKSIZE = 256
# the dtypes bitsandbytes' 4-bit (de)quantization accepts
_BNB_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# device types bitsandbytes has 4-bit kernels for here; elsewhere the math runs on the CPU
_BNB_DEVICE_TYPES = ("cpu", "cuda")


class LinearNf4(QuantizedLinear):
    """State dict: `weight` (uint8, [ceil(out*in/2), 1], two codes a byte), `absmax` (one per block of
    64 values: float32, or uint8 with double_quant), `quant_map` (float32 [16], the NF4 code table),
    with double_quant also `nested_absmax` (float32, one per 256 absmax), `nested_quant_map`
    (float32 [256]) and `nested_offset` (float32, 0-dim); `bias`.

    Option `double_quant` (default True): quantize the absmax too (bitsandbytes compress_statistics).
    """

    mode = "nf4"

    def __init__(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype,
                 device: torch.device | str | None = None, double_quant: bool = True):
        super().__init__(in_features, out_features, bias, compute_dtype, device=device)
        self.double_quant = bool(double_quant)
        numel = in_features * out_features
        blocks = math.ceil(numel / BLOCKSIZE)
        # shapes as quantize_4bit returns them, so a fresh layer takes a state_dict before quantizing
        self.weight = nn.Parameter(torch.zeros((numel + 1) // 2, 1, dtype=torch.uint8, device=device),
                                   requires_grad=False)
        self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.uint8 if self.double_quant else torch.float32,
                                                   device=device))
        self.register_buffer("quant_map", torch.zeros(16, dtype=torch.float32, device=device))
        if self.double_quant:
            self.register_buffer("nested_absmax", torch.zeros(math.ceil(blocks / NESTED_BLOCKSIZE),
                                                              dtype=torch.float32, device=device))
            self.register_buffer("nested_quant_map", torch.zeros(256, dtype=torch.float32, device=device))
            self.register_buffer("nested_offset", torch.zeros((), dtype=torch.float32, device=device))

    def _quant_tensor_names(self) -> tuple[str, ...]:
        names = ("weight", "absmax", "quant_map")
        return names + (("nested_absmax", "nested_quant_map", "nested_offset") if self.double_quant else ())

    @torch.no_grad()
    def quantize_weight(self, weight: torch.Tensor) -> None:
        from bitsandbytes.functional import quantize_4bit

        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(weight.shape)} for a layer of shape "
                             f"{(self.out_features, self.in_features)}")
        storage = self.weight.device
        work_device = storage if storage.type in _BNB_DEVICE_TYPES else torch.device("cpu")
        dense = weight.detach().to(work_device)
        if dense.dtype not in _BNB_FLOAT_DTYPES:
            dense = dense.to(torch.float32)
        packed, state = quantize_4bit(dense.contiguous(), blocksize=BLOCKSIZE, compress_statistics=self.double_quant,
                                      quant_type="nf4")
        if self.double_quant and state.state2.blocksize != NESTED_BLOCKSIZE:
            # the buffer shapes above assume bitsandbytes' nested blocksize; say so if it changes
            raise RuntimeError(f"bitsandbytes used nested blocksize {state.state2.blocksize}, "
                               f"LinearNf4 expects {NESTED_BLOCKSIZE}")
        # copy_: strict on shape, so a bitsandbytes layout change is an error, not a silent resize
        self.weight.copy_(packed)
        self.absmax.copy_(state.absmax)
        self.quant_map.copy_(state.code)
        if self.double_quant:
            self.nested_absmax.copy_(state.state2.absmax)
            self.nested_quant_map.copy_(state.state2.code)
            self.nested_offset.copy_(state.offset)

    def unquantized_weight(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        device = torch.device(device)
        if device.type == "meta" and self.weight.device.type == "meta":
            # a layer of the planner's meta architecture holds no codes: its weight is only a shape
            # (what dequantizing elsewhere and moving the result here would leave on meta; without
            # importing bitsandbytes, which pulls in torch._inductor: 1.4 CPU s of a `plan` process)
            return torch.empty((self.out_features, self.in_features), dtype=dtype, device=device)
        from bitsandbytes.functional import QuantState, dequantize_4bit

        # dequantize where the result goes when bitsandbytes runs there (moving 4-bit codes is
        # cheaper than moving the dense weight), else where the storage is, else on the CPU
        if device.type in _BNB_DEVICE_TYPES:
            work_device = device
        elif self.weight.device.type in _BNB_DEVICE_TYPES:
            work_device = self.weight.device
        else:
            work_device = torch.device("cpu")
        tensors = {name: getattr(self, name).detach().to(work_device) for name in self._quant_tensor_names()}
        nested = None
        if self.double_quant:
            nested = QuantState(absmax=tensors["nested_absmax"], code=tensors["nested_quant_map"],
                                blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
        work_dtype = dtype if dtype in _BNB_FLOAT_DTYPES else torch.float32
        state = QuantState(absmax=tensors["absmax"], shape=torch.Size((self.out_features, self.in_features)),
                           code=tensors["quant_map"], blocksize=BLOCKSIZE, quant_type="nf4", dtype=work_dtype,
                           offset=tensors.get("nested_offset"), state2=nested)
        dense = dequantize_4bit(tensors["weight"], state)
        return dense.to(device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, double_quant={self.double_quant}"
