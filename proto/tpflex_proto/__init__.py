"""tpflex shared types: generated protobuf/gRPC code (``make proto``), the etcd key layout,
the etcd value codec and the etcd client wrapper."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tpflex-proto")  # from the git tags at build time (setuptools-scm)
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
