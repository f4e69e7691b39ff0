"""Re-export: free-port helpers live in ``tpflex_proto.devtools``."""

from tpflex_proto.devtools.ports import free_port, free_ports  # noqa: F401
