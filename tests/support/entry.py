"""A service's console script called in the test process: its entry point
(``tpflex_controller.main:main``, ``tpflex_agent.main:main``) with the arguments and an
environment of its own (no inherited TPFLEX_* variables), stdout, stderr and the exit
status captured, for checks of what it prints and refuses before it starts anything
(``--print-config``, ``--help``, bad values): a process would spend a second or two
importing the service to print the same lines. The tests that need the process itself
(its exit status without a traceback, a service that starts) run the console script."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import traceback


def call_service(service: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """What ``tpflex-<service> ARGS`` prints and returns, in this process. An exception
    escaping the entry point is printed as the interpreter would, status 1."""
    if service == "controller":
        from tpflex_controller.main import main
    elif service == "agent":
        from tpflex_agent.main import main
    else:
        raise ValueError(f"no service {service!r}")
    saved = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.clear()
        os.environ.update({k: v for k, v in saved.items() if not k.startswith("TPFLEX_")}, **(env or {}))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse: --help, unrecognized arguments
                code = exc.code if isinstance(exc.code, int) else 1
            except Exception:  # noqa: BLE001 - the traceback a process would print
                traceback.print_exc()
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess([f"tpflex-{service}", *args], code or 0, out.getvalue(), err.getvalue())
