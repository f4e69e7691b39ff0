"""Rendered JSON of large, rarely changing responses (a job's plan lists every GPU and
cap), kept per job and reused while the stored object is the same one. The watch-fed
cache replaces an object whenever its key changes, so identity is the version; reads
from etcd (``EtcdState``) produce fresh objects and simply never hit."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel


class RenderMemo:
    """At most ``max_entries`` rendered responses (least recently used out): deleted jobs'
    plans do not stay."""

    def __init__(self, max_entries: int = 1024) -> None:
        self._lock = threading.Lock()
        self._max = max_entries
        self._kept: OrderedDict[tuple[str, str], tuple[object, bytes]] = OrderedDict()
        self._flights: dict[tuple[str, str], tuple[object, threading.Event]] = {}

    def json(self, kind: str, name: str, source: object, render: Callable[[], BaseModel | bytes]) -> Response:
        """The JSON of ``render()`` (a model, or its JSON already) for ``source`` (rendered
        once per source object)."""
        return Response(content=self.body(kind, name, source, render), media_type="application/json")

    def body(self, kind: str, name: str, source: object, render: Callable[[], BaseModel | bytes]) -> bytes:
        """``json``'s body. Callers that ask for the same (kind, name, source) while it is
        being rendered wait for that render (single flight: a background pass and a
        request, or several requests, render a plan once)."""
        key = (kind, name)
        while True:
            with self._lock:
                kept = self._kept.get(key)
                if kept is not None:
                    self._kept.move_to_end(key)
                    if kept[0] is source:
                        return kept[1]
                flight = self._flights.get(key)
                if flight is None or flight[0] is not source:
                    mine = threading.Event()
                    self._flights[key] = (source, mine)
                    break
            flight[1].wait()  # rendered (or failed) by another thread: look again
        try:
            made = render()
            body = made if isinstance(made, bytes) else JSONResponse(made.model_dump(mode="json")).body
            with self._lock:
                self._kept[key] = (source, body)
                while len(self._kept) > self._max:
                    self._kept.popitem(last=False)
            return body
        finally:
            with self._lock:
                if self._flights.get(key, (None, None))[1] is mine:
                    del self._flights[key]
            mine.set()

    def peek(self, kind: str, name: str) -> tuple[object, bytes] | None:
        """What is kept for (kind, name): (source, body), or None; renders nothing."""
        with self._lock:
            return self._kept.get((kind, name))

    def value(self, kind: str, name: str, sources: tuple, make: Callable[[], object]) -> object:
        """``make()``, kept while every object of ``sources`` is the same one (identity)."""
        key = (kind, name)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
        if kept is not None and len(kept[0]) == len(sources) and all(
                a is b for a, b in zip(kept[0], sources, strict=True)):
            return kept[1]
        made = make()
        with self._lock:
            self._kept[key] = (sources, made)
            while len(self._kept) > self._max:
                self._kept.popitem(last=False)
        return made
