"""The optimizers' configs, one file each; each registers itself in OPTIMIZERS (optimizer_configs.py)."""
