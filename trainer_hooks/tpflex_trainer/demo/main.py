"""`tpflex-demo`: the end-to-end story on this machine, with nothing else to install.

Exit codes: 0 success, 1 the story failed (a phase timed out, parity or a bound broken),
2 bad usage or the demo's ports are taken.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from tpflex_trainer.demo.cluster import DemoPorts, PortsTaken, new_workdir
from tpflex_trainer.demo.story import JOB, Story, StoryConfig
from tpflex_trainer.demo.summary import render, summarize

PARITY_TOLERANCE = 1e-5


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpflex-demo", description=__doc__.splitlines()[0])
    p.add_argument("--base-port", type=int, default=DemoPorts.base,
                   help="first of the loopback ports the demo uses (default %(default)s)")
    p.add_argument("--steps", type=int, default=160, help="training steps (default %(default)s)")
    p.add_argument("--fail-at", type=int, default=30, help="step at which the GPU fails")
    p.add_argument("--repair-at", type=int, default=90, help="step at which it is repaired")
    p.add_argument("--keep-running", action="store_true",
                   help="leave etcd, the controller and the agents up afterwards (Ctrl-C stops)")
    p.add_argument("--workdir", type=Path, help="where logs and data go (default: a temp dir)")
    p.add_argument("--model", type=Path, metavar="DIR",
                   help="a Hugging Face model directory (config.json [+ safetensors]) to train "
                        "instead of the built-in GPT; small models keep the demo quick on CPU")
    p.add_argument("--pp", type=int, default=1, choices=(1, 2),
                   help="pipeline stages per replica: 1 (2 racks x 4 GPUs, 2 replicas x TP 4) or 2 "
                        "(4 racks x 2 GPUs, 2 replicas x PP 2 x TP 2; a GPU of one stage fails)")
    p.add_argument("--tls", action="store_true",
                   help="secure everything: development certificates in the workdir, etcd with "
                        "TLS and auth, mTLS between services and on the plan stream, REST over "
                        "HTTPS with admin and read-only tokens")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if not 0 < a.fail_at < a.repair_at < a.steps:
        p.error("need 0 < --fail-at < --repair-at < --steps")
    if not 1024 <= a.base_port <= 65000:
        p.error("--base-port must be within 1024..65000")
    if a.pp > 1 and a.model is not None:
        p.error("--pp 2 trains the built-in GPT; --model needs --pp 1")
    model = None
    if a.model is not None:
        error = _check_model_config(a.model)
        if error is None:
            model, error = _load_model(a.model)
        if error is not None:
            p.error(f"--model: {error}")
    if a.workdir is not None:
        error = _check_workdir(a.workdir)
        if error is not None:
            p.error(f"--workdir: {error}")
    workdir = a.workdir or new_workdir()
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    story = Story(StoryConfig(workdir=workdir, base_port=a.base_port, steps=a.steps,
                              fail_at_step=a.fail_at, repair_at_step=a.repair_at, tls=a.tls,
                              model_dir=str(a.model) if a.model else None, pp=a.pp), say)
    try:
        story.start()
    except PortsTaken as exc:
        print(f"tpflex-demo: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, OSError) as exc:
        story.stop()
        print(f"tpflex-demo: the services did not start: {exc}\n"
              f"tpflex-demo: logs kept in {workdir}", file=sys.stderr)
        return 1
    ok = False
    try:
        run = story.play()
        summary = summarize(run, model)
        print(render(summary, run), flush=True)
        ok = summary.parity_max_rel_diff <= PARITY_TOLERANCE and not summary.violations()
        say(f"done in {time.monotonic() - t0:.1f}s: " + ("SUCCESS" if ok else "FAILED"))
    except (RuntimeError, TimeoutError, AssertionError) as exc:
        print(f"tpflex-demo: the story failed: {exc}", file=sys.stderr)
    finally:
        if story.launcher is not None:
            story.launcher.stop()
        if a.keep_running and not _keep_running(story):
            ok = False  # a service died while the demo was kept running
        story.stop()
        if ok and a.workdir is None and not a.keep_running:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not ok:
            print(f"tpflex-demo: logs kept in {workdir}", file=sys.stderr)
    return 0 if ok else 1


# The demo trains on CPU, in several processes at once: a --model above this many
# parameters (fp32 weights + Adam state, per process) is refused before anything is built.
MAX_MODEL_PARAMS = 1_000_000_000
_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads")


def _config_errors() -> tuple[type[BaseException], ...]:
    from tpflex_trainer.ntp.errors import NtpError

    errors: list[type[BaseException]] = [NtpError, OSError, ValueError, TypeError, KeyError, AttributeError]
    try:  # what huggingface_hub's strict config dataclasses raise (not a ValueError)
        from huggingface_hub.errors import StrictDataclassError

        errors.append(StrictDataclassError)
    except ImportError:  # an older huggingface_hub: its errors are ValueErrors
        pass
    return tuple(errors)


def _check_model_config(model_dir: Path) -> str | None:
    """Why the config.json of ``model_dir`` cannot be a demo model (a field of the wrong
    type, a size that is not a positive integer, more than MAX_MODEL_PARAMS parameters),
    or None. Reads the config only: nothing is allocated."""
    from tpflex_trainer.ntp.hf_adapter import load_config

    try:
        config = load_config(model_dir)
    except _config_errors() as exc:
        return _one_line(exc)
    sizes: dict[str, int] = {}
    for name in _SIZE_FIELDS:
        value = getattr(config, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name} in config.json must be a positive integer, got {value!r}"
        sizes[name] = value
    hidden, vocab = sizes.get("hidden_size", 1), sizes.get("vocab_size", 1)
    ffn = sizes.get("intermediate_size", 4 * hidden)
    params = 2 * vocab * hidden + sizes.get("num_hidden_layers", 1) * (4 * hidden * hidden + 3 * hidden * ffn)
    if params > MAX_MODEL_PARAMS:
        return (f"about {params:.3g} parameters; the demo trains on CPU and takes at most "
                f"{MAX_MODEL_PARAMS:,} (use a small model)")
    return None


def _load_model(model_dir: Path):
    """(the demo model, None), or (None, why it cannot be built)."""
    from tpflex_trainer.demo.model import demo_model

    try:
        return demo_model(str(model_dir)), None
    except (*_config_errors(), RuntimeError) as exc:
        return None, _one_line(exc)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 400 else text[:397] + "..."


def _check_workdir(workdir: Path) -> str | None:
    """Why the demo cannot write in ``workdir`` (created if missing), or None."""
    if workdir.exists() and not workdir.is_dir():
        return f"{workdir} exists and is not a directory"
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / ".tpflex-demo-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return f"cannot write in {workdir}: {exc.strerror or exc}"
    return None


def _keep_running(story: Story, interval_s: float = 1.0) -> bool:
    """Leave the services up until Ctrl-C / SIGTERM (True), or until one of them exits:
    then say which, with its exit code and log, and return False (the caller stops the
    others; the dead one is reaped, not left a zombie)."""
    c = story.cluster
    print(_explore_tls(story) if c.tls else _explore(story), flush=True)
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(interval_s):
        dead = c.dead_services()
        if dead:
            for name, code in dead:
                print(f"tpflex-demo: {name} exited with code {code} (log: {c.log_of(name)})",
                      file=sys.stderr, flush=True)
            print("tpflex-demo: a service is gone; stopping the others", file=sys.stderr, flush=True)
            return False
    return True


def _explore_tls(story: Story) -> str:
    c = story.cluster
    ca, read, admin = c.certs.ca, c.workdir / "readonly.tokens", c.workdir / "admin.tokens"
    return f"""
services are up with TLS (Ctrl-C to stop them); certificates in {c.certs.directory}:
  REST:     curl --cacert {ca} -H "Authorization: Bearer $(cat {read})" {c.rest_url}/v1/status
  metrics:  curl --cacert {ca} {c.rest_url}/metrics | grep tpflex_
  agents:   curl --cacert {ca} https://127.0.0.1:{story.ports.agent_metrics(0)}/metrics
  SSL_CERT_FILE={ca} tpflexctl --url {c.rest_url} --token-file {read} status
  SSL_CERT_FILE={ca} tpflexctl --url {c.rest_url} --token-file {admin} drain node-0 1 --reason test
"""


def _explore(story: Story) -> str:
    c = story.cluster
    return f"""
services are up (Ctrl-C to stop them):
  REST:     curl {c.rest_url}/v1/status ; curl {c.rest_url}/v1/jobs/{JOB}/plan
  metrics:  curl {c.rest_url}/metrics | grep tpflex_
  agents:   curl http://127.0.0.1:{story.ports.agent_metrics(0)}/metrics
  tpflexctl --url {c.rest_url} status
  tpflexctl --url {c.rest_url} --token-file {c.workdir / 'admin.tokens'} drain node-0 1 --reason test
"""


if __name__ == "__main__":
    sys.exit(main())
