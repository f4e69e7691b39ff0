"""The hooks a training script imports to follow the tpflex controller's plans."""
