"""Re-export: the etcd launcher lives in ``tpflex_proto.devtools`` (the demo uses it too)."""

from tpflex_proto.devtools.etcd_server import ETCD_BIN, EtcdCluster, EtcdMember  # noqa: F401
