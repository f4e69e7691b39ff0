"""A rank for the zygote tests: prints one JSON line of what a rank can see of how it was
started (argv, cwd, environment, session, ``__name__``, ``sys.path[0]``, whether the
zygote's preloaded module is already imported), registers an atexit line, then acts on
its first argument: ``exit:N``, ``raise``, ``message`` (``sys.exit("...")``), ``wait``
(until a signal)."""

import atexit
import json
import os
import signal
import sys

print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("ZYGOTE_TEST"),
                  "sid_is_pid": os.getsid(0) == os.getpid(), "name": __name__, "path0": sys.path[0],
                  "preloaded": "email.mime.text" in sys.modules, "stdin": sys.stdin.read()}), flush=True)
atexit.register(lambda: print("atexit ran", flush=True))
what = sys.argv[1]
if what.startswith("exit:"):
    sys.exit(int(what[5:]))
if what == "raise":
    raise RuntimeError("the rank's own error")
if what == "message":
    sys.exit("a message to stderr")
if what == "wait":
    print("waiting", flush=True)
    signal.pause()
