"""Run a command with some system calls denied (EPERM), as a systemd unit's
``SystemCallFilter=`` with ``SystemCallErrorNumber=EPERM`` denies them:
``python seccomp_deny.py CALL[,CALL...] -- CMD ARGS...`` (or ``@FILE``: names one per line).

A classic-BPF seccomp filter installed with ``prctl`` (no_new_privs first, so no
privilege is needed), kept across ``execve`` and inherited by every child, as systemd's
is. Linux on x86-64, with the kernel's system-call numbers from linux-libc-dev's
``asm/unistd_64.h`` (which the C toolchain that builds the fake NVML library brings)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
import sys
from pathlib import Path

UNISTD = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
AUDIT_ARCH_X86_64 = 0xC000003E


def supported() -> bool:
    return sys.platform == "linux" and platform.machine() == "x86_64" and UNISTD.is_file()


def syscall_numbers() -> dict[str, int]:
    """name -> number of every x86-64 system call this kernel header knows."""
    return {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)", UNISTD.read_text())}


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def deny(names: list[str]) -> None:
    """From now on, in this process and all it starts, the named calls fail with EPERM
    (names this header does not know are skipped: systemd skips them too)."""
    numbers = syscall_numbers()
    nrs = sorted({numbers[n] for n in names if n in numbers})
    ld_w_abs, jeq_k, ret_k = 0x20, 0x15, 0x06
    allow, eperm = 0x7FFF0000, 0x00050000 | errno.EPERM
    prog = [(ld_w_abs, 0, 0, 4),  # seccomp_data.arch
            (jeq_k, 1, 0, AUDIT_ARCH_X86_64),
            (ret_k, 0, 0, allow),  # another ABI: not filtered here
            (ld_w_abs, 0, 0, 0)]  # seccomp_data.nr
    for nr in nrs:  # short jumps only (a jump offset is 8 bits)
        prog += [(jeq_k, 0, 1, nr), (ret_k, 0, 0, eperm)]
    prog.append((ret_k, 0, 0, allow))
    filters = (_Filter * len(prog))(*[_Filter(*f) for f in prog])
    fprog = _Prog(len(prog), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: seccomp_deny.py CALL[,CALL...]|@FILE -- CMD ARGS...", file=sys.stderr)
        return 2
    spec = argv[0]
    names = Path(spec[1:]).read_text().split() if spec.startswith("@") else spec.split(",")
    deny(names)
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
