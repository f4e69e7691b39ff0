"""The PromQL name check used on the alerts and the dashboard finds what it must find."""

from __future__ import annotations

import pytest

from tests.deploy.promql import PromQLNameError, analyse, problems, rule_exprs
from tests.deploy.tools import metric_catalog


def test_metric_names_are_read_around_functions_matchers_ranges_and_grouping():
    use = analyse(
        'histogram_quantile(0.99, sum by (le, phase) (rate(tpflex_reconfiguration_seconds_bucket'
        '{phase=~"$phase"}[$__rate_interval]))) > on (job) group_left max by (job) '
        "(tpflex_plan_generation offset 1h30m) * 1e3 or vector(0)"
    )
    assert use.metrics == {"tpflex_reconfiguration_seconds_bucket", "tpflex_plan_generation"}
    assert use.matcher_labels == {"tpflex_reconfiguration_seconds_bucket": {"phase"}}
    assert use.grouping_labels == {"le", "phase", "job"}


def test_strings_never_count_as_names():
    use = analyse('label_replace(up{job="tpflex_fake_metric"}, "dst", "x", "src", "(.*)")')
    assert use.metrics == {"up"}


def test_an_unknown_function_is_an_error_not_a_metric():
    with pytest.raises(PromQLNameError, match="made_up_fn"):
        analyse("made_up_fn(tpflex_plan_generation)")


def test_undocumented_names_and_labels_are_reported():
    catalog = metric_catalog()
    assert problems("max by (job) (tpflex_plan_generation)", catalog) == []
    assert problems("tpflex_not_a_metric > 0", catalog) == ["undocumented metric 'tpflex_not_a_metric'"]
    assert problems('tpflex_gpu_power_cap_watts{rack="r1"}', catalog) == [
        "metric 'tpflex_gpu_power_cap_watts' has no label 'rack'"
    ]
    assert problems("sum by (cause) (tpflex_plan_generation)", catalog) == [
        "no metric here has label 'cause'"
    ]
    # A histogram is only visible through its _bucket/_sum/_count series.
    assert problems("tpflex_reconfiguration_seconds", catalog) == [
        "undocumented metric 'tpflex_reconfiguration_seconds'"
    ]
    assert problems("rate(tpflex_reconfiguration_seconds_count[5m])", catalog) == []


def test_rule_exprs_reads_inline_and_block_values():
    text = """groups:
  - name: g
    rules:
      - alert: A
        expr: up == 0
        for: 1m
      - alert: B
        expr: |
          max by (job) (tpflex_plan_generation)
            > 3
        labels:
          severity: x
      - record: c
        expr: "sum(up)"
"""
    assert rule_exprs(text) == ["up == 0", "max by (job) (tpflex_plan_generation) > 3", "sum(up)"]
