"""``tpflexctl events --watch`` and ``tpflexctl plan JOB --watch`` (follow the console's
live stream: no polling), and ``tpflexctl completion bash|zsh``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from tpflex_proto import backoff

from tpflex_cli.client import Client, CliError, ProtocolError

Printer = Callable[[str], None]


def _follow(client: Client, on_message: Callable[[str, object], None], err: Printer) -> None:
    """Feed every stream message to ``on_message``. Whenever the stream ends (dropped, or
    ended by the controller, which it does when it loses etcd) print one line and
    reconnect after the shared jittered back-off, which starts over only after a stream
    that delivered data: a controller that accepts and at once ends every stream is not
    hammered, and a fleet of watchers does not reconnect in lockstep. 4xx (bad token,
    unknown job) and unreadable messages end the watch with the error."""
    retry = backoff.Backoff(1.0, 10.0)
    while True:
        why = "the controller ended the stream"
        try:
            for name, data in client.stream("/v1/console/stream"):
                if name == "error":  # the controller's view lost etcd; the stream ends next
                    why = f"the controller ended the stream: {_error_text(data)}"
                    continue
                retry.reset()
                try:
                    on_message(name, data)
                except (KeyError, TypeError, AttributeError, IndexError) as exc:
                    raise ProtocolError(f"unexpected {name!r} stream message from {client.base} "
                                        f"({exc!r})") from None
        except ProtocolError:
            raise
        except CliError as exc:
            if exc.exit_code == 2:
                raise
            why = str(exc)
        pause = retry.next()
        err(f"tpflexctl: {why}; reconnecting in {pause:.1f} s")
        time.sleep(pause)  # Ctrl-C here ends the watch (KeyboardInterrupt: exit 130)


def _error_text(data: object) -> str:
    """The message of the stream's ``error`` event, on one line."""
    text = data.get("message") if isinstance(data, dict) else None
    return " ".join(str(text if text else data).split())[:300]


def watch_events(client: Client, args: argparse.Namespace, show_rows, out: Printer, err: Printer) -> None:
    """The latest ``--limit`` events, then each new one as the controller records it."""
    state = {"last": 0, "header": True}

    def on_message(name: str, data) -> None:
        if name == "snapshot":
            events = data["events"]
        elif name == "events":
            events = data
        else:
            return
        events = [e for e in events if e["seq"] > state["last"] and (args.job is None or e["job"] == args.job)]
        if name == "snapshot" and state["last"] == 0:
            events = events[-args.limit:]
        if not events:
            return
        state["last"] = max(state["last"], events[-1]["seq"])
        out(show_rows(events, header=state["header"]))
        state["header"] = False

    _follow(client, on_message, err)


def watch_plan(client: Client, job: str, show_plan, out: Printer, err: Printer) -> None:
    """The job's plan now, then each new generation as the leader commits it."""
    path = f"/v1/jobs/{_quote(job)}"
    client.call("GET", path)  # 404 for an unknown job, before following anything
    state = {"generation": None}

    def on_message(name: str, data) -> None:
        jobs = data["jobs"] if name == "snapshot" else data if name == "jobs" else None
        if jobs is None:
            return
        current = next((j for j in jobs if j["name"] == job), None)
        if current is None or current["generation"] in (None, state["generation"]):
            return
        state["generation"] = current["generation"]
        out(show_plan(client.call("GET", path + "/plan")))

    _follow(client, on_message, err)


def _quote(part: str) -> str:
    import urllib.parse

    return urllib.parse.quote(part, safe="")


# ---- shell completion ----


def completion(parser: argparse.ArgumentParser, shell: str) -> str:
    """A completion script for ``shell`` generated from the parser (commands, options,
    choices); zsh loads the bash one through bashcompinit."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    top = [o for a in parser._actions for o in a.option_strings]
    cases = []
    for name, p in sorted(sub.choices.items()):
        opts = [o for a in p._actions for o in a.option_strings]
        cases.append(f'    {name}) words="{" ".join(opts)}";;')
    choices = []
    for name, p in sorted(sub.choices.items()):
        for a in p._actions:
            if a.choices and a.option_strings:
                for o in a.option_strings:
                    choices.append(f'    "{name} {o}") words="{" ".join(map(str, a.choices))}";;')
    script = _BASH.format(
        commands=" ".join(sorted(sub.choices)), top=" ".join(top),
        cases="\n".join(cases), choices="\n".join(choices) or '    "") ;;',
    )
    if shell == "zsh":
        return "autoload -U +X bashcompinit && bashcompinit\n" + script
    return script


_BASH = """# tpflexctl completion (bash). Install: tpflexctl completion bash > /etc/bash_completion.d/tpflexctl
_tpflexctl() {{
  local cur prev cmd words="" i
  cur="${{COMP_WORDS[COMP_CWORD]}}"
  prev="${{COMP_WORDS[COMP_CWORD-1]}}"
  for ((i = 1; i < COMP_CWORD; i++)); do
    case "${{COMP_WORDS[i]}}" in -*) ;; *) if [[ " {commands} " == *" ${{COMP_WORDS[i]}} "* ]]; then cmd="${{COMP_WORDS[i]}}"; break; fi;; esac
  done
  if [[ -z "$cmd" ]]; then
    case "$prev" in --token-file|--cacert) COMPREPLY=($(compgen -f -- "$cur")); return;; esac
    COMPREPLY=($(compgen -W "{commands} {top}" -- "$cur")); return
  fi
  case "$cmd $prev" in
{choices}
  esac
  if [[ -z "$words" ]]; then
    case "$cmd" in
{cases}
    esac
  fi
  COMPREPLY=($(compgen -W "$words" -- "$cur"))
}}
complete -F _tpflexctl tpflexctl
"""


def print_err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
