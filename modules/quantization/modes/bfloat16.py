"""bfloat16: the part stored densely in bfloat16 (auto's first dense choice)."""

from modules.quantization.weight_modes import dense_mode, register_weight_mode

register_weight_mode(dense_mode("bfloat16", 2, auto_preference=0))
