"""Re-export: the etcd launcher lives in ``tpflex_controller.devtools`` (the demo uses it too)."""

from tpflex_controller.devtools.etcd_server import ETCD_BIN, EtcdCluster, EtcdMember  # noqa: F401
