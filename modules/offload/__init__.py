"""Layer offloading (LayerOffloadConductor) and gradient checkpointing."""
