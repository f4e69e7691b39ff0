"""tpflex trainer hooks: the nonuniform tensor-parallel runtime (layouts, resharding,
gradient sync across TP degrees, checkpoints) and the hooks that connect a training
script to the controller."""

__version__ = "0.1.0"
