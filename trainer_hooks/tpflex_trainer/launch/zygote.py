"""The preloading launch ("zygote"): one server process imports torch and the other listed
modules once, then forks each rank from that warm interpreter and runs the rank's script
(``python script.py ARGS``) or module (``python -m module ARGS``) in it with ``runpy``: a
rank starts in milliseconds instead of paying seconds of CPU to import torch (more with
transformers), on its first start and on every restart (docs/launch.md, "Preloading").

The forked rank is what ``subprocess.Popen`` would have started: the rank's environment,
argv, working directory, stdin/stdout/stderr (passed as file descriptors), a session of
its own (``killpg(pid)`` reaches it and its helpers), atexit handlers run at exit, and its
exit status (``-N`` when killed by signal N). It is the server's child, so the launcher
learns the exit over a per-rank socket: :class:`ZygoteProc` is the ``Popen``-like handle
(``pid``, ``returncode``, ``poll``, ``wait``, ``fileno`` for ``select``).

Caveats (what differs from a fresh interpreter): the preloaded modules were imported with
the launcher's environment, so settings they read at import time come from there (the
rank's ``OMP_NUM_THREADS`` is applied again with ``torch.set_num_threads``); the server
must not initialise CUDA (importing torch does not; a preload that does is the user's
error, CUDA cannot be used after a fork); interpreter options (``python -u``, ``-X``, ``-c``)
are not supported, such a command falls back to ``Popen``. Linux only (``fork``,
``SCM_RIGHTS``).

Protocol: a ``SOCK_SEQPACKET`` pair between the launcher and the server. The server sends
``{"ready": true}`` (or ``{"error": ...}``) once its imports are done; each request is one
JSON message ``{"kind": "script"|"module", "target", "args", "env", "cwd"}`` with four
descriptors (the rank's status socket, stdin, stdout, stderr), answered ``{"pid": N}``
or ``{"error": ...}``; the rank's exit status comes as ``{"exit": CODE}`` on its status
socket. The server exits when the launcher's end closes (its ranks keep running); it
ignores SIGINT and SIGTERM (the launcher's to handle). If it dies all the same, its
ranks' exits cannot be told any more: :class:`ZygoteProc` then kills the rank's process
group and reports it killed (-SIGKILL), and the launcher restarts it with Popen.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

_MAX_MSG = 1 << 20
_PYTHON = re.compile(r"python[0-9.]*$")


class ZygoteError(RuntimeError):
    pass


@dataclass(frozen=True)
class Entry:
    """What a ``python`` command runs: a script path or a module, and its arguments."""
    kind: str  # "script" | "module"
    target: str
    args: tuple[str, ...]


def entry_of(command: Sequence[str]) -> Entry | None:
    """``python script.py ARGS`` / ``python -m module ARGS`` -> the entry; anything else
    (not a python, interpreter options, ``-c``, no script) -> None: start it with Popen."""
    if len(command) < 2 or not _PYTHON.match(os.path.basename(command[0])):
        return None
    if command[1] == "-m":
        return Entry("module", command[2], tuple(command[3:])) if len(command) > 2 and command[2] else None
    if command[1].startswith("-"):
        return None
    return Entry("script", command[1], tuple(command[2:]))


# ---------------------------------------------------------------- the launcher's side

class ZygoteProc:
    """A rank forked by the zygote, as much of ``subprocess.Popen`` as the launchers use."""

    def __init__(self, pid: int, status: socket.socket, args: Sequence[str]) -> None:
        self.pid, self.args, self._status = pid, list(args), status
        self.returncode: int | None = None

    def fileno(self) -> int:
        """Readable once the rank has exited (for ``select``)."""
        return self._status.fileno()

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self._status], [], [], 0)
            if ready:
                self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ready, _, _ = select.select([self._status], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_exit()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read_exit(self) -> None:
        try:
            data = self._status.recv(_MAX_MSG)
        except OSError:
            data = b""
        if data:
            self.returncode = int(json.loads(data)["exit"])
        else:  # the zygote is gone: nobody can tell the exit any more; make sure it is over
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.returncode = -signal.SIGKILL
        self._status.close()


class Zygote:
    """The server process, started with ``python`` (the ranks' interpreter) and ``env``
    (the launcher's environment: what the preloaded modules are imported with). With
    ``wait=False`` the constructor returns while the server imports (the caller starts
    other things meanwhile); the first :meth:`spawn` (or :meth:`wait_ready`) waits for it."""

    def __init__(self, python: str, preload: Sequence[str], *, env: Mapping[str, str] | None = None,
                 cwd: str | None = None, ready_timeout_s: float = 300.0, wait: bool = True) -> None:
        self._ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()
        self._preload, self._ready_timeout_s, self._ready = list(preload), ready_timeout_s, False
        try:
            self.proc = subprocess.Popen(
                [python, "-m", "tpflex_trainer.launch.zygote", str(theirs.fileno()), ",".join(preload)],
                pass_fds=(theirs.fileno(),), env=None if env is None else dict(env), cwd=cwd,
                stdin=subprocess.DEVNULL)
        except OSError as exc:
            self._ctl.close()
            raise ZygoteError(f"cannot start {python}: {exc}") from None
        finally:
            theirs.close()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Return once the server has imported its modules; ZygoteError (and the server
        stopped) if it could not."""
        if self._ready:
            return
        ready, _, _ = select.select([self._ctl], [], [], self._ready_timeout_s)
        reply = self._reply() if ready else {"error": f"not ready within {self._ready_timeout_s:.0f} s"}
        if not reply.get("ready"):
            self.close()
            raise ZygoteError(f"preloading {','.join(self._preload)}: {reply.get('error', 'no reply')}")
        self._ready = True

    def spawn(self, entry: Entry, args: Sequence[str], env: Mapping[str, str], cwd: str | None = None,
              stdin: int | None = None, stdout: int | None = None, stderr: int | None = None) -> ZygoteProc:
        """Fork a rank running ``entry`` (``args``: the whole command, for messages);
        ``None`` streams are the launcher's own."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        request = {"kind": entry.kind, "target": entry.target, "args": list(entry.args), "env": dict(env),
                   "cwd": os.path.abspath(cwd or os.getcwd())}
        fds = [theirs.fileno(), 0 if stdin is None else stdin, 1 if stdout is None else stdout,
               2 if stderr is None else stderr]
        try:
            with self._lock:
                self.wait_ready()
                socket.send_fds(self._ctl, [json.dumps(request).encode()], fds)
                reply = self._reply()
        except OSError as exc:
            mine.close()
            raise ZygoteError(f"the zygote is gone: {exc}") from None
        finally:
            theirs.close()
        if "pid" not in reply:
            mine.close()
            raise ZygoteError(reply.get("error", "the zygote is gone"))
        return ZygoteProc(int(reply["pid"]), mine, args)

    def _reply(self) -> dict:
        try:
            data = self._ctl.recv(_MAX_MSG)
        except OSError:
            data = b""
        return json.loads(data) if data else {}

    def close(self) -> None:
        """Stop the server (the ranks it forked keep running)."""
        self._ctl.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------- the server

def _serve(ctl: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    statuses: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([ctl, wake_r], [], [])
        if wake_r in ready:
            try:
                os.read(wake_r, 512)
            except BlockingIOError:
                pass
            _reap(statuses)
        if ctl in ready:
            try:
                data, fds, _, _ = socket.recv_fds(ctl, _MAX_MSG, 4)
            except OSError:
                data, fds = b"", []
            if not data:
                return  # the launcher is gone
            try:
                pid = _fork_rank(json.loads(data), fds, ctl, wake_r, wake_w, statuses)
                statuses[pid] = socket.socket(fileno=fds.pop(0))
                reply = {"pid": pid}
            except Exception as exc:  # noqa: BLE001 - told to the launcher, the server goes on
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                for fd in fds:
                    os.close(fd)
            ctl.send(json.dumps(reply).encode())


def exited_children() -> Iterator[tuple[int, int]]:
    """(pid, exit code as Popen reports it) of each child that has exited, without
    waiting for the others (they are reaped: call it where ``SIGCHLD`` woke you)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _reap(statuses: dict[int, socket.socket]) -> None:
    for pid, code in exited_children():
        sock = statuses.pop(pid, None)
        if sock is not None:
            try:
                sock.send(json.dumps({"exit": code}).encode())
            except OSError:
                pass  # the launcher stopped listening
            sock.close()


def _fork_rank(request: dict, fds: list[int], ctl: socket.socket, wake_r: int, wake_w: int,
               statuses: dict[int, socket.socket]) -> int:
    if len(fds) != 4:
        raise ZygoteError(f"expected 4 descriptors, got {len(fds)}")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the rank: from here on nothing returns to the server's loop
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setsid()
        for i, fd in enumerate(fds[1:]):
            os.dup2(fd, i)
        for fd in (*fds, wake_r, wake_w):
            os.close(fd)
        ctl.close()
        for sock in statuses.values():
            sock.close()
        code = _run(request)
    except BaseException:  # noqa: BLE001 - a rank's set-up error is its exit status
        import traceback
        traceback.print_exc()
    finally:
        os._exit(code)


def _run(request: dict) -> int:
    """Run the rank's entry as ``python`` would; its exit status."""
    import atexit
    import runpy
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))
    code = 0
    try:
        if request["kind"] == "module":
            sys.modules.pop(request["target"], None)  # as with `python -m`: only __main__ runs it
            sys.argv = ["-m", *request["args"]]
            sys.path[0] = request["cwd"]
            runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(request["target"])
            sys.argv = [request["target"], *request["args"]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - like the interpreter: the traceback, status 1
        import traceback
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    ctl = socket.socket(fileno=int(argv[0]))
    # a terminal's ^C, or a scheduler's SIGTERM to every process of the job (Slurm's
    # scancel), is for the launcher to handle: it drains the ranks with their grace period,
    # and the zygote leaves when the launcher does (its socket closes). A zygote gone
    # early would cost every running rank (their exits can no longer be told: killed)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        import gc
        import importlib
        for name in filter(None, argv[1].split(",")):
            importlib.import_module(name)
        gc.collect()
        gc.freeze()  # the ranks share these pages instead of copying them on the next collection
    except BaseException as exc:  # noqa: BLE001 - the launcher falls back to Popen
        ctl.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        return 1
    if "torch" in sys.modules and getattr(sys.modules["torch"], "cuda", None) is not None \
            and sys.modules["torch"].cuda.is_initialized():
        ctl.send(json.dumps({"error": "a preloaded module initialised CUDA (not usable after fork)"}).encode())
        return 1
    ctl.send(json.dumps({"ready": True}).encode())
    _serve(ctl)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
