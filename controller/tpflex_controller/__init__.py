"""tpflex controller: etcd-backed cluster state, the NTP planner, leader election,
the reconcile loop, the REST API, metrics and `tpflex-sim` (`tpflexctl` is tpflex-cli, cli/)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tpflex-controller")  # from the git tags at build time (setuptools-scm)
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
