"""The key maps of the tools that load saved adapter files (ComfyUI, Forge), rebuilt from their
public loaders' source as facts, and the check a save runs through them (check.py)."""
