"""``tpflex-run``: the node launcher (one per node) that starts, supervises and restarts
the node's local ranks. Imports neither torch nor any web framework."""
