"""Cursor pagination of the list endpoints: ``?limit=N&after=CURSOR``.

Items are sorted by a stable key (a name); the cursor is the last returned item's key, so
a page is the same whatever was added or removed before it. When more items follow, the
response carries ``X-Next-Cursor: <cursor>`` and ``Link: <url>; rel="next"``. Without
``limit`` the whole list is returned (as before pagination existed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, TypeVar

from fastapi import Query, Request, Response
from pydantic import BeforeValidator

from tpflex_controller.api.params import canonical_int

T = TypeVar("T")

MAX_PAGE = 10_000
PageLimit = Annotated[int | None, BeforeValidator(canonical_int), Query(ge=1, le=MAX_PAGE, description="page size (default: everything)")]
After = Annotated[str | None, Query(max_length=600, description="cursor: X-Next-Cursor of the previous page")]


def page(items: Sequence[T], key: Callable[[T], str], limit: int | None, after: str | None,
         request: Request, response: Response) -> list[T]:
    """``items`` (sorted by ``key``) after the cursor, at most ``limit`` of them."""
    start = 0
    if after is not None:
        start = next((i for i, item in enumerate(items) if key(item) > after), len(items))
    end = len(items) if limit is None else min(len(items), start + limit)
    if end < len(items):
        cursor = key(items[end - 1])
        response.headers["X-Next-Cursor"] = cursor
        url = request.url.include_query_params(after=cursor, limit=limit)
        response.headers["Link"] = f'<{url}>; rel="next"'
    return list(items[start:end])


def gpu_cursor(node: str, index: int) -> str:
    """A GPU's cursor, ``node:index`` (GPUs list in (node, index) order)."""
    return f"{node}:{index:07d}"


def parse_gpu_cursor(after: str) -> tuple[str, int]:
    """The (node, index) a GPU cursor names; the list resumes after it. A cursor without
    an index (``node``, or a text that is not ``node:digits``) resumes at that name's
    first GPU. Compare the pair, not the string: string order puts ``node10:0000000``
    before ``node1:0000001``."""
    node, sep, index = after.rpartition(":")
    if sep and index.isascii() and index.isdigit():
        return node, int(index)
    return after, -1
