"""One etcd informer per process: the list-and-watch of ``/tpflex/v1/`` (client-go's
SharedInformer is the model).

The informer lists the prefix once, then watches it from the next revision. It keeps the
current items (key, parsed key, value, mod revision, decoded message), tracks the revision
it has folded, and hands typed change records to registered handlers:

- a handler registered at any time first gets the current state (one ``initial`` batch
  of puts, in key order: a plan's parts sort before its header), then every later batch;
- each watch response becomes one batch of changes in revision order;
- when etcd has compacted the history the watch needs, the informer lists again at a
  fresh revision and delivers the differences (puts of new or changed keys, deletes of
  vanished ones) as one ``resync`` batch, then watches on from that revision.

Values are decoded once, here (``keys.parse`` + the message type of the key kind; plan
headers and parts stay bytes: tpflex_proto.planstore assembles them), on the first look
at a change's message, so that changes no handler reads cost nothing (the echo of the
controller's own commit: a plan, a dozen power plans, an event). Change records are
read-only; the messages in them are shared by every handler and must be treated as
read-only. Handlers run on the informer's feeder thread, one after the other, and must be
quick (hand the batch to a queue); one that raises is logged and the others still run.

What it holds: ``keep`` (the kinds whose current items, value and message, it keeps for
``items()``, ``get()`` and the first batch of a handler registered after the first sync;
None, the default: every kind). Of any other kind it keeps each key's mod revision only
(what a re-list after a compaction compares), so that a process whose handlers fold the
values into state of their own (the controller: its view holds what it needs, plan
history it never reads) does not hold a second copy of every value under the prefix.
Every change of every kind still reaches every handler in the batches, and the first
sync's batch holds the whole listed state (handlers registered before ``start()``).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from google.protobuf.message import Message

from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.backoff import Backoff
from tpflex_proto.etcd import Etcd, EtcdError, KeyValue, Watch, WatchEvent
from tpflex_proto.keys import Key, Kind

log = logging.getLogger(__name__)

# the message type of each key kind; kinds not listed keep their bytes only
MESSAGE_TYPES: dict[Kind, type[Message]] = {
    Kind.NODE: types_pb2.Node,
    Kind.HEALTH: types_pb2.NodeHealth,
    Kind.RACK: types_pb2.Rack,
    Kind.JOB_SPEC: types_pb2.JobSpec,
    Kind.JOB_ACK: types_pb2.Ack,
    Kind.GPU_OVERRIDE: types_pb2.GpuOverride,
    Kind.JOB_OVERRIDE: types_pb2.JobOverride,
    Kind.POWER: types_pb2.NodePowerPlan,
    Kind.EVENT: types_pb2.Event,
    Kind.LEADER: types_pb2.LeaderRecord,
}


class Op(enum.Enum):
    PUT = "put"
    DELETE = "delete"


_UNDECODED = object()


class Change:
    """One key's change. ``msg`` is the decoded value (None for a delete, a kind kept as
    bytes, or a malformed value: ``malformed`` says which). The value is decoded once, on
    the first look at ``msg`` or ``malformed`` (a change no handler reads, such as the
    echo of a controller's own commit, costs no decoding on the watch's thread);
    concurrent first looks may both decode, to equal messages. Read-only."""

    __slots__ = ("_malformed", "_msg", "key", "mod_revision", "op", "parsed", "value")

    def __init__(
        self, op: Op, key: str, parsed: Key | None, value: bytes, mod_revision: int,
        msg: Message | None | object = None, malformed: bool = False,
    ) -> None:
        self.op = op
        self.key = key
        self.parsed = parsed
        self.value = value
        self.mod_revision = mod_revision
        self._msg = msg
        self._malformed = malformed

    @property
    def msg(self) -> Message | None:
        if self._msg is _UNDECODED:
            self._decode()
        return self._msg  # type: ignore[return-value]

    @property
    def malformed(self) -> bool:
        if self._msg is _UNDECODED:
            self._decode()
        return self._malformed

    def _decode(self) -> None:
        cls = MESSAGE_TYPES[self.parsed.kind]  # type: ignore[union-attr]
        try:
            msg = codec.decode(cls, self.value, self.key)
        except codec.MalformedValue as exc:
            log.warning("skipping malformed etcd value key=%s error=%s", self.key, exc)
            self._malformed = True
            self._msg = None
            return
        self._msg = msg

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Change):
            return NotImplemented
        return (self.op, self.key, self.parsed, self.value, self.mod_revision, self.msg, self.malformed) == (
            other.op, other.key, other.parsed, other.value, other.mod_revision, other.msg, other.malformed)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Change(op={self.op}, key={self.key!r}, mod_revision={self.mod_revision})"

    @property
    def deleted(self) -> bool:
        return self.op is Op.DELETE

    @property
    def kind(self) -> str:
        """"put" or "delete" (the etcd watch's spelling)."""
        return self.op.value

    def key_value(self) -> KeyValue:
        return KeyValue(self.key, self.value, 0, self.mod_revision, 0, 0)


@dataclass(frozen=True, slots=True)
class Batch:
    """What a handler gets: ``changes`` in order, the informer's ``revision`` after them;
    ``initial``: the whole current state (the handler's first batch); ``resync``: the
    differences found by a list after a compaction."""

    changes: tuple[Change, ...]
    revision: int
    initial: bool = False
    resync: bool = False


Handler = Callable[[Batch], None]
Unregister = Callable[[], None]


def decode_change(op: Op, key: str, value: bytes, mod_revision: int) -> Change:
    """The change record of one key (pure apart from a log line for a malformed value)."""
    parsed = keys.parse(key)
    if op is Op.DELETE or parsed is None:
        return Change(op, key, parsed, b"" if op is Op.DELETE else value, mod_revision)
    if parsed.kind not in MESSAGE_TYPES:
        return Change(op, key, parsed, value, mod_revision)
    return Change(op, key, parsed, value, mod_revision, _UNDECODED)  # decoded on first look


def diff(revs: Mapping[str, int], listed: list[KeyValue], revision: int) -> list[Change]:
    """What changed between the keys held (key -> mod revision) and a fresh list at
    ``revision`` (pure)."""
    out: list[Change] = []
    seen: set[str] = set()
    for kv in listed:
        seen.add(kv.key)
        if revs.get(kv.key) != kv.mod_revision:
            out.append(decode_change(Op.PUT, kv.key, kv.value, kv.mod_revision))
    for key in sorted(set(revs) - seen):
        out.append(Change(Op.DELETE, key, keys.parse(key), b"", revision))
    return out


class Informer:
    """``start()`` lists and watches ``prefix`` (retrying while etcd is away);
    ``add_handler(h)`` registers a handler (current state first); ``stop()`` ends it.
    ``keep``: the kinds whose items it holds after the first sync (module docstring)."""

    def __init__(
        self, etcd: Etcd, prefix: str = keys.PREFIX, *, retry_s: float = 0.5,
        keep: frozenset[Kind] | None = None,
    ) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.keep = keep
        self._backoff = Backoff(min(0.05, retry_s), retry_s)
        self._lock = threading.RLock()  # items, revision and handler calls
        self._changed = threading.Condition(self._lock)
        self._items: dict[str, Change] = {}
        self._revs: dict[str, int] = {}  # the keys not in _items: key -> mod revision
        self._revision = 0
        self._handlers: list[Handler] = []
        self._watch: Watch | None = None
        self._relist = threading.Event()
        self._stop = threading.Event()
        self._listed = False
        self.synced = threading.Event()  # listed once and the watch established after it
        self._thread = threading.Thread(target=self._run, name="informer", daemon=True)

    # ---- lifecycle ----

    def start(self) -> Informer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._relist.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)
        w = self._watch
        if w is not None:
            w.cancel()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._list()
            except EtcdError as exc:
                log.info("informer cannot list etcd; retrying prefix=%s error=%s", self.prefix, exc)
                self._stop.wait(self._backoff.next())
                continue
            self._backoff.reset()
            self._relist.clear()
            self._watch = self.etcd.watch_prefix(
                self.prefix, self._on_events, start_revision=self._revision + 1,
                on_resync=self._on_compacted,
            )
            if not self.synced.is_set():
                self._sync_when_watching(self._watch)
            self._relist.wait()

    def _sync_when_watching(self, watch: Watch) -> None:
        """Synced once the first watch is established: handlers get the state then."""
        while not watch.established.wait(0.05):
            if self._stop.is_set() or self._relist.is_set():
                return
        with self._changed:
            self.synced.set()
            self._changed.notify_all()
            log.info("informer synced prefix=%s revision=%d keys=%d", self.prefix, self._revision, len(self._items))
            self._publish(Batch(self._snapshot(), self._revision, initial=True))
            self._drop_unkept()

    def _list(self) -> None:
        kvs, rev = self.etcd.get_prefix(self.prefix)
        with self._changed:
            if not self._listed:
                changes = [decode_change(Op.PUT, kv.key, kv.value, kv.mod_revision) for kv in kvs]
            else:
                changes = diff(self._held_revs(), kvs, rev)
            self._apply(changes)
            self._revision = max(self._revision, rev)
            self._changed.notify_all()
            if self._listed and self.synced.is_set():
                log.warning("informer re-listed after compaction revision=%d changes=%d", rev, len(changes))
                self._publish(Batch(tuple(changes), self._revision, resync=True))
            self._listed = True

    def _on_compacted(self) -> None:
        """On the watch's thread: the history it needs is gone; list again (our thread)."""
        log.warning("etcd history compacted: informer lists again prefix=%s", self.prefix)
        w = self._watch
        if w is not None:
            w.cancel()  # from its own thread: it ends after this callback
        self._relist.set()

    # ---- folding and delivery ----

    def _on_events(self, events: list[WatchEvent]) -> None:
        changes = [
            decode_change(Op.DELETE if ev.kind == "delete" else Op.PUT, ev.key, ev.value, ev.mod_revision)
            for ev in events
        ]
        with self._changed:
            if self._stop.is_set() or self._relist.is_set():
                return  # a stale watch's last events: the re-list covers them
            self._apply(changes)
            self._revision = max(self._revision, changes[-1].mod_revision)
            self._changed.notify_all()
            if self.synced.is_set():  # else the initial batch will hold them
                self._publish(Batch(tuple(changes), self._revision))

    def _apply(self, changes: list[Change]) -> None:
        keep_all = self.keep is None or not self.synced.is_set()  # the first batch: all
        for c in changes:
            if c.deleted:
                self._items.pop(c.key, None)
                self._revs.pop(c.key, None)
            elif keep_all or self._kept(c.parsed):
                self._items[c.key] = c
            else:
                self._items.pop(c.key, None)
                self._revs[c.key] = c.mod_revision

    def _kept(self, parsed: Key | None) -> bool:
        return self.keep is None or (parsed is not None and parsed.kind in self.keep)

    def _drop_unkept(self) -> None:
        """After the first sync's batch: the kinds not kept keep their revisions only."""
        if self.keep is None:
            return
        for key in [k for k, c in self._items.items() if not self._kept(c.parsed)]:
            self._revs[key] = self._items.pop(key).mod_revision

    def _held_revs(self) -> dict[str, int]:
        revs = dict(self._revs)
        revs.update((k, c.mod_revision) for k, c in self._items.items())
        return revs

    def _publish(self, batch: Batch) -> None:
        for handler in list(self._handlers):
            _call(handler, batch)

    def add_handler(self, handler: Handler) -> Unregister:
        """Register ``handler``; if the informer is synced, it gets the current state
        first (on this thread: the items of the kinds it keeps), else when it syncs (the
        whole listed state). Returns the unregister call."""
        with self._lock:
            if self.synced.is_set():
                _call(handler, Batch(self._snapshot(), self._revision, initial=True))
            self._handlers.append(handler)

        def unregister() -> None:
            with self._lock:
                if handler in self._handlers:
                    self._handlers.remove(handler)

        return unregister

    def locked(self) -> threading.RLock:
        """``with informer.locked():`` no batch is delivered, and ``items`` and
        ``revision`` stay as they are, while it is held (a handler's owner reads the current
        state and starts taking batches with nothing in between). Hold it briefly."""
        return self._lock

    def _snapshot(self) -> tuple[Change, ...]:
        return tuple(self._items[k] for k in sorted(self._items))

    # ---- reads ----

    @property
    def revision(self) -> int:
        with self._lock:
            return self._revision

    @property
    def connected(self) -> bool:
        """Listed and watching etcd now (the watch is established)."""
        w = self._watch
        return self.synced.is_set() and not self._relist.is_set() and w is not None and w.established.is_set()

    def get(self, key: str) -> Change | None:
        """The current item of ``key`` (None: none, or a kind the informer does not keep)."""
        with self._lock:
            return self._items.get(key)

    def items(self, prefix: str = "") -> list[Change]:
        """The current items under ``prefix``, in key order (of the kinds it keeps)."""
        with self._lock:
            return [c for k, c in sorted(self._items.items()) if k.startswith(prefix)]

    def wait_revision(self, revision: int, timeout: float) -> bool:
        """Block until the informer has folded ``revision``."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self.synced.is_set() and self._revision >= revision, timeout
            )


def _call(handler: Handler, batch: Batch) -> None:
    try:
        handler(batch)
    except Exception:  # one handler's bug must not stop the others or the informer
        log.exception("informer handler failed handler=%r", handler)
