"""The list pages' renders kept current in the background, so that a request finds them
made instead of making them (and 200 clients arriving at once do not all miss).

Before it, the REST process rendered only when asked: after a quiet spell under GPU churn
the first reads of ``/v1/status`` and ``/v1/gpus?state=failed`` each folded a minute's
changed nodes into the status index (0.8 s), and ``/v1/racks`` re-rendered its changed
racks, all at the moment the clients arrived (bench/load.py: the slow requests of a REST
run were its first seconds).

:class:`Prerenderer` subscribes to the API view's change feed (api/feed.py) and, on its
own thread, a short ``settle_s`` after a batch arrives (changes of that time are done in
one pass), renders what the batch changed: the rows of the changed nodes and the status
index (``ApiStateCache.status_counts``) and the views of their racks. After a (re-)list
the cache's warm-up renders every node's rows and the status index, then
``render_all`` (wired as its ``on_warm``) every rack; passes wait for that warm-up. Each
pass costs O(what changed); requests still render what they find missing (the renders are
the same functions, keyed by the same versions), so the pages' bodies do not depend on
whether a pass has run.

Plans are not rendered ahead: a new plan is rendered by its first reader (once, whoever
asks: ``RenderMemo.body``, from per-replica pieces, ``views.plan_json``). Rendering each
generation of every job in the background was most of the process's CPU while nobody
read plans (py-spy, bench/load.py's churn), for a request's 2 ms saved.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from tpflex_controller.api.errors import ApiError
from tpflex_controller.api.feed import Change, Kind

log = logging.getLogger(__name__)

_NODE_KINDS = frozenset({Kind.NODE, Kind.HEALTH, Kind.GPU_OVERRIDE})


@dataclass
class Pending:
    """What changed since the last pass."""

    nodes: set[str] = field(default_factory=set)
    racks: set[str] = field(default_factory=set)
    revision: int = 0  # the newest change's

    def add(self, changes: list[Change]) -> None:
        for c in changes:
            self.revision = max(self.revision, c.revision)
            if c.kind in _NODE_KINDS:
                self.nodes.add(c.name)
            elif c.kind is Kind.RACK:
                self.racks.add(c.name)

    def __bool__(self) -> bool:
        return bool(self.nodes or self.racks)


class Prerenderer:
    """``start()`` subscribes to ``cache`` and starts the thread; ``stop()``. ``revision``:
    the newest change a finished pass covered (``wait_revision``, for tests)."""

    def __init__(self, cache, *, settle_s: float = 0.05) -> None:
        self.cache, self.settle_s = cache, settle_s
        self.revision = 0
        self._pending = Pending()
        self._cv = threading.Condition()
        self._stop = False
        self._busy = False  # a pass is running
        self._unsubscribe = None
        self._thread = threading.Thread(target=self._run, name="api-prerender", daemon=True)

    def start(self) -> Prerenderer:
        self._unsubscribe = self.cache.subscribe(self._on_changes)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.ident is not None:
            self._thread.join(5)

    def _on_changes(self, changes: list[Change]) -> None:
        """On the informer's thread: note them, wake the pass (quick, as the feed asks)."""
        with self._cv:
            self._pending.add(changes)
            if not self._pending and not self._busy:  # nothing to render: covered now
                self.revision = max(self.revision, self._pending.revision)
            self._cv.notify_all()

    def wait_revision(self, revision: int, timeout: float) -> bool:
        """Block until a pass covering the changes up to ``revision`` has finished."""
        with self._cv:
            return self._cv.wait_for(lambda: self.revision >= revision, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or bool(self._pending))
                if self._stop:
                    return
                # a batch rarely comes alone (a commit is several keys, a failure
                # re-plans): let the ones just behind it join this pass
                self._cv.wait_for(lambda: self._stop, self.settle_s)
                if self._stop:
                    return
                pending, self._pending = self._pending, Pending()
                self._busy = True
            try:
                if self.cache.warm:  # before: the warm-up renders it all (render_all)
                    self.render(pending)
            except ApiError:
                pass  # not synced or etcd lost: requests render on demand once it is back
            except Exception as exc:  # a bug here must not stop the passes; requests render
                log.error("prerender pass failed error=%r", exc)
            with self._cv:
                self._busy = False
                self.revision = max(self.revision, pending.revision)
                if not self._pending:  # what came meanwhile needs no render
                    self.revision = max(self.revision, self._pending.revision)
                self._cv.notify_all()

    def render_all(self) -> None:
        """Every rack's view (after a (re-)list: ``ApiStateCache(on_warm=)``, whose warm-up
        rendered the rows and the status index)."""
        try:
            self._render(self.cache.rack_names())
        except ApiError:
            pass  # etcd went away meanwhile: requests render on demand

    def render(self, pending: Pending) -> None:
        """One pass over ``pending`` (on the caller's thread)."""
        cache = self.cache
        cache.status_counts()  # folds the changed nodes' rows into the status index
        self._render(sorted(pending.racks | cache.racks_of(pending.nodes)))

    def _render(self, racks: list[str]) -> None:
        for i in range(0, len(racks), 64):
            self.cache.rack_rows(racks[i:i + 64])
