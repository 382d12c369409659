"""Each family's adapter key layout, declared as data (one file per family) and read by
modules/model/adapter_keys.py: how kohya, ComfyUI and diffusers files name a module's adapter."""
