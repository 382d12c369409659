"""The adapter algorithms' configs, one file each; each registers itself in ADAPTERS (adapter_configs.py)."""
