"""A stand-in rank for the tpflex-run tests: records what happens to it (start, SIGTERM,
finish) as JSON lines in $RECORDS_DIR/rank-<local rank>.jsonl, then waits for signals.

CHILD_MODE: ``wait`` (default: SIGTERM -> record, exit 0; SIGUSR1 -> record, exit 0),
``stubborn`` on the local rank named by STUBBORN_RANK (records SIGTERM, keeps running),
``crash`` on CRASH_RANK (exit CRASH_CODE at once), ``once`` (record and exit 0 at once).
"""

import json
import os
import signal
import sys
import time

ENV_KEYS = ("TPFLEX_CONTROLLER", "TPFLEX_JOB", "TPFLEX_JOB_SPEC", "TPFLEX_NODE", "TPFLEX_GPU",
            "TPFLEX_GPU_UUID", "TPFLEX_STORE", "TPFLEX_LOCAL_RANK", "TPFLEX_RESTART_COUNT",
            "TPFLEX_CUDA_DEVICE", "TPFLEX_TLS_CA", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES", "RANK", "OMP_NUM_THREADS",
            "TPFLEX_JOB_CREDENTIAL_FILE", "TPFLEX_REGISTER_TOKEN_FILE")

local = os.environ["TPFLEX_LOCAL_RANK"]
path = os.path.join(os.environ["RECORDS_DIR"], f"rank-{local}.jsonl")


def record(event: str, **extra) -> None:
    line = json.dumps({"event": event, "pid": os.getpid(), "local_rank": int(local),
                       "t": time.monotonic(), **extra}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())  # one write: lines never interleave
    finally:
        os.close(fd)


mode = os.environ.get("CHILD_MODE", "wait")
stubborn = os.environ.get("STUBBORN_RANK") == local
crash = os.environ.get("CRASH_RANK") == local


def on_term(signum, frame):
    record("sigterm")
    if not stubborn:
        sys.exit(0)


def on_usr1(signum, frame):
    record("finish")
    sys.exit(int(os.environ.get("FINISH_CODE", "0")))


signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR1, on_usr1)
record("start", env={k: os.environ.get(k) for k in ENV_KEYS}, argv=sys.argv[1:], ppid=os.getppid())
if crash:
    sys.exit(int(os.environ.get("CRASH_CODE", "5")))
if mode == "once":
    sys.exit(0)
while True:
    signal.pause()
