"""float32: the part stored densely in float32 (auto's dense choice only where bfloat16 does not run)."""

from modules.quantization.weight_modes import dense_mode, register_weight_mode

register_weight_mode(dense_mode("float32", 4, auto_preference=1))
