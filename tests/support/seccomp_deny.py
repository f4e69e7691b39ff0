"""Run a command with some system calls denied (EPERM), as a systemd unit's
``SystemCallFilter=`` denies them: ``python seccomp_deny.py CALL[,CALL...] -- CMD ARGS...``.

A classic-BPF seccomp filter installed with ``prctl`` (no_new_privs first, so no
privilege is needed), kept across ``execve`` and inherited by every child, as systemd's
is. Linux on x86-64 or aarch64 only."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys

# per architecture: its AUDIT_ARCH value and the system calls' numbers
ARCHES = {
    "x86_64": (0xC000003E, {"setpriority": 141, "sched_setaffinity": 203}),
    "aarch64": (0xC00000B7, {"setpriority": 140, "sched_setaffinity": 122}),
}


def supported() -> bool:
    return sys.platform == "linux" and platform.machine() in ARCHES


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def deny(names: list[str]) -> None:
    audit_arch, numbers = ARCHES[platform.machine()]
    nrs = [numbers[n] for n in names]
    ld_w_abs, jeq_k, ret_k = 0x20, 0x15, 0x06
    allow, eperm = 0x7FFF0000, 0x00050000 | errno.EPERM
    m = len(nrs)
    prog = [(ld_w_abs, 0, 0, 4),  # seccomp_data.arch
            (jeq_k, 0, m + 1, audit_arch),  # another ABI: allowed
            (ld_w_abs, 0, 0, 0)]  # seccomp_data.nr
    prog += [(jeq_k, m - i, 0, nr) for i, nr in enumerate(nrs)]
    prog += [(ret_k, 0, 0, allow), (ret_k, 0, 0, eperm)]
    filters = (_Filter * len(prog))(*[_Filter(*f) for f in prog])
    fprog = _Prog(len(prog), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: seccomp_deny.py CALL[,CALL...] -- CMD ARGS...", file=sys.stderr)
        return 2
    deny(argv[0].split(","))
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
