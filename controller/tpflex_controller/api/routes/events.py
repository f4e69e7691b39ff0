"""The bounded event log of controller decisions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from tpflex_controller.api import schemas as s
from tpflex_controller.api import views
from tpflex_controller.api.deps import Deps
from tpflex_controller.api.params import JOB_PATTERN, Limit

router = APIRouter(tags=["events"])


@router.get("/events", response_model=s.EventList, summary="Latest events, oldest first")
def list_events(
    deps: Deps,
    limit: Limit = 100,
    job: Annotated[str | None, Query(pattern=JOB_PATTERN)] = None,
) -> s.EventList:
    events = deps.reads.events(limit, job)
    return s.EventList(events=[views.event_view(e) for e in events])
