"""tpflexctl: the command-line client of the tpflex controller's REST API (httpx, PyYAML
and the protobuf-free part of tpflex_proto; nothing of the controller, gRPC or etcd)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tpflex-cli")  # from the git tags at build time (setuptools-scm)
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
