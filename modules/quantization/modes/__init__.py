"""The built-in weight modes, one file each: each registers its `WeightMode` on import
(modules/quantization/weight_modes.py reads this package the first time the registry is read)."""
