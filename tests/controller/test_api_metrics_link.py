"""The REST process's /metrics: the controller's metrics come through the link (a real
socket pair) as the controller wrote them, unparsed, ahead of the REST process's own."""

from __future__ import annotations

import socket

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tpflex_controller.api.deps import ApiDeps
from tpflex_controller.api.link import LinkClient, LinkServer
from tpflex_controller.api.respcache import ResponseCacheCollector
from tpflex_controller.api.routes.system import metrics


def test_the_controllers_metrics_are_passed_through_ahead_of_the_rest_processes():
    controller = CollectorRegistry()
    Counter("tpflex_plans_committed", "plans", ["job"], registry=controller).labels("j").inc(3)
    ours, theirs = socket.socketpair()
    server = LinkServer(theirs, controller, None)
    client = LinkClient(ours)
    rest = CollectorRegistry()
    stats = {"hits": 5}
    rest.register(ResponseCacheCollector(stats))
    deps = ApiDeps(store=None, etcd=None, tokens=None, registry=rest, metrics_prefix=client.metrics_text)
    try:
        body = metrics(deps).body
        assert body.startswith(generate_latest(controller))  # byte for byte, as written
        values = {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for f in text_string_to_metric_families(body.decode()) for s in f.samples}
        assert values[("tpflex_plans_committed_total", (("job", "j"),))] == 3.0
        assert values[("tpflex_rest_response_cache_total", (("result", "hits"),))] == 5.0
    finally:
        server.close()
        ours.close()
    # the link gone: the REST process's own metrics are still served
    body = metrics(deps).body
    assert body == generate_latest(rest)
