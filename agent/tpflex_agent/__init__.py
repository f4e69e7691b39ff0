"""tpflex node agent: GPU backends (NVML, simulated), power/clock control, health
reporting to etcd, the agent gRPC service and metrics."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tpflex-agent")  # from the git tags at build time (setuptools-scm)
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
