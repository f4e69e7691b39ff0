"""Just enough PromQL lexing to check which metric names and labels an expression uses.

Not a parser: it blanks strings, label matchers, ranges and grouping clauses, then reads
the identifiers that are left. Every identifier followed by "(" must be a known function
or aggregation (so an unknown one is reported, never mistaken for a metric); every other
identifier that is not a keyword is a metric name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

FUNCTIONS = frozenset(
    """abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil
    changes clamp clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week
    day_of_year days_in_month deg delta deriv exp floor histogram_count histogram_fraction
    histogram_quantile histogram_sum holt_winters hour idelta increase irate label_join
    label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time
    minute month pi predict_linear present_over_time quantile_over_time rad rate resets
    round scalar sgn sin sinh sort sort_desc sqrt stddev_over_time stdvar_over_time
    sum_over_time tan tanh time timestamp vector year""".split()
)
AGGREGATIONS = frozenset(
    "sum min max avg group stddev stdvar count count_values bottomk topk quantile".split()
)
KEYWORDS = frozenset(
    "by without on ignoring group_left group_right bool and or unless offset atan2".split()
)
NUMBER_WORDS = frozenset({"inf", "nan"})
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
TEMPLATE_VAR = re.compile(r"\$\{?\w+(?::\w+)?\}?")
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}")
MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
DURATION_OR_NUMBER = re.compile(
    r"(?<![A-Za-z0-9_:.])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?(?:(?:ms|[smhdwy])\d*)*)"
)
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


class PromQLNameError(ValueError):
    """An expression uses something the lexer does not know (e.g. an unknown function)."""


@dataclass
class ExprUse:
    """What one expression uses: metric names, labels per selector, grouping labels."""

    metrics: set[str] = field(default_factory=set)
    matcher_labels: dict[str, set[str]] = field(default_factory=dict)
    grouping_labels: set[str] = field(default_factory=set)


def analyse(expr: str) -> ExprUse:
    """Metric names and label names that a PromQL expression uses."""
    use = ExprUse()
    text = TEMPLATE_VAR.sub("5m", STRING.sub('""', expr))
    for match in SELECTOR.finditer(text):
        labels = set(MATCHER_LABEL.findall(match.group(2)))
        if match.group(1) and match.group(1) not in KEYWORDS:
            use.matcher_labels.setdefault(match.group(1), set()).update(labels)
    text = SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", text)
    for match in GROUPING.finditer(text):
        use.grouping_labels.update(x.strip() for x in match.group(2).split(",") if x.strip())
    text = GROUPING.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = DURATION_OR_NUMBER.sub(" ", text)
    for match in IDENT.finditer(text):
        token = match.group(0)
        if token in KEYWORDS or token.lower() in NUMBER_WORDS:
            continue
        if text[match.end():].lstrip().startswith("("):
            if token in FUNCTIONS or token in AGGREGATIONS:
                continue
            raise PromQLNameError(f"unknown PromQL function {token!r} in {expr!r}")
        use.metrics.add(token)
    return use


def rule_exprs(rules_yaml: str) -> list[str]:
    """The ``expr:`` values of a Prometheus rule file (inline or block scalars).

    A line-based reader for our own rule files (PyYAML is not a project dependency);
    callers cross-check the count with ``promtool check rules``.
    """
    exprs: list[str] = []
    lines = rules_yaml.splitlines()
    i = 0
    while i < len(lines):
        match = re.match(r"^(\s*)(?:-\s+)?expr:\s*(.*)$", lines[i])
        i += 1
        if not match:
            continue
        indent, value = len(match.group(1)), match.group(2).strip()
        if value and value[0] not in "|>":
            exprs.append(_unquote(value))
            continue
        block: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > indent):
            block.append(lines[i].strip())
            i += 1
        exprs.append(" ".join(x for x in block if x))
    return exprs


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: str
    labels: frozenset[str]


# Labels Prometheus itself attaches to every scraped series, and its own series.
TARGET_LABELS = frozenset({"instance", "job"})
BUILTIN_METRICS = {"up": MetricSpec("up", "gauge", frozenset())}
HISTOGRAM_SUFFIXES = {"_bucket": {"le"}, "_sum": set(), "_count": set()}


def series_spec(name: str, catalog: dict[str, MetricSpec]) -> MetricSpec | None:
    """The documented metric a series name belongs to (histograms expose three series)."""
    if name in catalog:
        spec = catalog[name]
        return None if spec.type == "histogram" else spec
    for suffix, extra in HISTOGRAM_SUFFIXES.items():
        base = catalog.get(name.removesuffix(suffix)) if name.endswith(suffix) else None
        if base is not None and base.type == "histogram":
            return MetricSpec(name, "counter", base.labels | extra)
    return BUILTIN_METRICS.get(name)


def problems(expr: str, catalog: dict[str, MetricSpec]) -> list[str]:
    """Undocumented metric names and labels that no metric of the expression has."""
    use = analyse(expr)
    found: list[str] = []
    known_labels: set[str] = set(TARGET_LABELS)
    for name in sorted(use.metrics):
        spec = series_spec(name, catalog)
        if spec is None:
            found.append(f"undocumented metric {name!r}")
            continue
        known_labels |= spec.labels
        bad = use.matcher_labels.get(name, set()) - spec.labels - TARGET_LABELS
        found += [f"metric {name!r} has no label {label!r}" for label in sorted(bad)]
    found += [f"no metric here has label {x!r}" for x in sorted(use.grouping_labels - known_labels)]
    return found
