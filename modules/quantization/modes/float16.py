"""float16: the part stored densely in float16; never picked by auto: without loss scaling
float16's range overflows in training."""

from modules.quantization.weight_modes import dense_mode, register_weight_mode

register_weight_mode(dense_mode("float16", 2, auto_preference=None))
