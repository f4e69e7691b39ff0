"""tpflex trainer hooks: the nonuniform tensor-parallel runtime (layouts, resharding,
gradient sync across TP degrees, checkpoints) and the hooks that connect a training
script to the controller."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tpflex-trainer")  # from the git tags at build time (setuptools-scm)
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
