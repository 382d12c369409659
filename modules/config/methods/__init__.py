"""The training methods' configs, one file each; each registers itself in METHODS (method_configs.py)."""
