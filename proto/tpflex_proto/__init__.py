"""tpflex shared types: generated protobuf/gRPC code (``make proto``), the etcd key layout,
the etcd value codec and the etcd client wrapper."""

__version__ = "0.1.0"
