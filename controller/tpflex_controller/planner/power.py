"""Power caps of a plan (pure): boosts for reduced stages (ntp-pw), operator pins, and the
speed each stage reaches with them.

Rules (DESIGN.md "Power"):
- A stage running at degree t < T (or with slow GPUs of relative speed v < 1) needs
  T / (t * v) x speed. Its used GPUs get one uniform cap: the smallest power the model says
  reaches that speed, rounded up to a whole watt, limited by the GPU's max limit and by
  TDP * (1 + max_boost) (both rounded down to a whole watt). The max limit is the lowest
  of the used GPUs' own (``RackInfo.gpu_max_w``: what each GPU reports, at most the rack
  record's): a uniform cap must hold on every GPU, and TP runs at its slowest GPU.
- A stage whose used GPUs cannot go above TDP (a max limit at the default, as on many
  H100/H200 SXM boards) has no headroom: ``no_headroom`` is set, and the planner runs its
  replica as plain NTP (smaller local batch) when no reduced stage of it has headroom.
- The rack budget bounds the sum of the caps of the rack's usable GPUs. GPUs of the rack
  that this plan does not boost count at TDP (or at their operator pin); failed and
  drained GPUs count at 0. When several boosted stages share a rack and the budget runs
  short, they are water-filled: every stage gets min(its wish, L) for the largest L that
  fits.
- A cap never goes below TDP: a rack whose budget cannot fund TDP is not "un-boosted";
  such a stage simply stays at TDP and shrinks its batch like plain NTP.
- Healthy stages are not boosted. Operator power pins replace the computed cap of the
  pinned GPU, clamped to [min_w, max_w].
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from itertools import filterfalse, repeat

from tpflex_proto.powermodel import PowerModel

from tpflex_controller.planner.caps import UniformCaps
from tpflex_controller.planner.model import ClusterState, GpuKey, RackInfo, gpu_max, stage_max
from tpflex_controller.planner.stages import StageDraft

_EPS = 1e-9
_MISSING = object()


class Curve:
    """A power model's lookups memoised for one plan call: the stages of a plan need only
    a few distinct speeds and caps (one per lost-GPU count), so each is computed once.
    Built fresh by every plan call; answers exactly what the model answers."""

    __slots__ = ("_power", "_throughput", "max_power_ratio", "model", "solo", "text")

    def __init__(self, model: PowerModel) -> None:
        self.model = model
        self.max_power_ratio = model.max_power_ratio
        self._throughput: dict[float, float] = {}
        self._power: dict[float, float | None] = {}
        # the cap of a lone boosted stage over a whole rack without pins, by what decides
        # it (``_fill_rack``): most reduced stages of a plan share a few of these
        self.solo: dict[tuple, float | None] = {}
        # formatted numbers of reasons, by what they show: the same few for most stages
        self.text: dict[tuple, str] = {}

    def throughput(self, power_ratio: float) -> float:
        out = self._throughput.get(power_ratio)
        if out is None:
            out = self._throughput[power_ratio] = self.model.throughput(power_ratio)
        return out

    def power_for(self, throughput_ratio: float) -> float | None:
        out = self._power.get(throughput_ratio, _MISSING)
        if out is _MISSING:
            out = self._power[throughput_ratio] = self.model.power_for(throughput_ratio)
        return out  # type: ignore[return-value]


def no_headroom(max_w: float, tdp_w: float) -> bool:
    """Whether a max limit leaves no whole watt above TDP (caps are whole watts)."""
    return math.floor(max_w + 1e-6) <= tdp_w + _EPS


def headroom_text(stage: StageDraft) -> str:
    """Which GPUs of a stage without headroom cannot go above TDP, e.g. "node-3 GPUs max
    limit = default 700 W" (at most three nodes named)."""
    rack = stage.rack
    tdp = rack.tdp_w
    stuck = [g for g in stage.used if no_headroom(gpu_max(rack, g), tdp)]
    nodes = list(dict.fromkeys(g[0] for g in stuck))
    named = ", ".join(nodes[:3]) + (f" and {len(nodes) - 3} more nodes" if len(nodes) > 3 else "")
    top = max(gpu_max(rack, g) for g in stuck) if stuck else rack.max_w
    limit = f"= default {tdp:.0f} W" if abs(top - tdp) < 0.5 else f"{top:.0f} W <= default {tdp:.0f} W"
    return f"{named or 'rack ' + rack.name} GPUs max limit {limit}"


def pinned_w(rack: RackInfo, pin_w: float, gpu: GpuKey | None = None) -> float:
    """An operator's pin clamped to the GPU's limits (the rack's without ``gpu``)."""
    top = rack.max_w if gpu is None else gpu_max(rack, gpu)
    return min(max(pin_w, rack.min_w), top)


def slowest_speed(gpus: tuple[GpuKey, ...], speeds: Mapping[GpuKey, float]) -> float:
    if not speeds:
        return 1.0
    return min((speeds[g] for g in speeds.keys() & set(gpus)), default=1.0)


def stage_speed_need(stage: StageDraft, full_tp: int, speeds: Mapping[GpuKey, float]) -> float:
    return full_tp / (stage.degree * slowest_speed(stage.used, speeds))


def plan_boosts(
    stages: Iterable[StageDraft], cluster: ClusterState, full_tp: int, model: PowerModel | Curve
) -> None:
    """Set ``cap_w`` and ``needed_speed`` on every stage (of running replicas) that needs
    more than 1x speed: a stage at degree t needs T/t (``full_tp``: T, ``model.full_tp``)."""
    by_rack: dict[str, list[StageDraft]] = {}
    speeds = cluster.gpu_speed
    for s in stages:
        # without slow GPUs the need is T / t (slowest_speed is 1.0)
        need = stage_speed_need(s, full_tp, speeds) if speeds else full_tp / s.degree
        if need > 1.0 + _EPS:
            s.needed_speed = need
            by_rack.setdefault(s.rack.name, []).append(s)
    solo = model.solo if isinstance(model, Curve) else None
    pins = cluster.power_pins
    for group in by_rack.values():
        s = group[0]
        rack = s.rack
        if solo is None or len(group) > 1 or pins or rack.gpu_max_w or not _whole_rack(s.spec_gpus, rack):
            _fill_rack(group, cluster, model)
            continue
        # the same inputs give the same cap (the memo is this plan call's)
        key = (rack.tdp_w, rack.max_w, rack.power_budget_w, s.needed_speed, len(s.usable), s.degree)
        cap = solo.get(key, _MISSING)
        if cap is _MISSING:
            _fill_rack(group, cluster, model)
            cap = solo[key] = s.cap_w
        s.cap_w = cap  # type: ignore[assignment]
        s.no_headroom = no_headroom(rack.max_w, rack.tdp_w)


def _fill_rack(group: list[StageDraft], cluster: ClusterState, model: PowerModel | Curve) -> None:
    rack = group[0].rack
    tdp = rack.tdp_w
    boost_w = tdp * model.max_power_ratio
    pins = cluster.power_pins
    wants, counts = [], []
    for s in group:
        top = stage_max(rack, s.used)  # the lowest max limit of its GPUs
        s.no_headroom = no_headroom(top, tdp)
        limit_w = math.floor(min(top, boost_w) + 1e-6)
        ratio = model.power_for(s.needed_speed)
        want = limit_w if ratio is None else min(math.ceil(ratio * tdp - 1e-6), limit_w)
        wants.append(max(want, tdp))
        counts.append(len(list(filterfalse(pins.__contains__, s.used))) if pins else len(s.used))
    level = water_level(wants, counts, rack.power_budget_w - _fixed_w(group, cluster))
    for s, want in zip(group, wants, strict=True):
        cap = max(tdp, min(want, level))
        s.cap_w = None if cap == tdp else float(cap)


def _fixed_w(group: list[StageDraft], cluster: ClusterState) -> float:
    """Watts of the rack's usable GPUs this plan does not boost (at TDP or their pin), in
    rack order."""
    rack, pins = group[0].rack, cluster.power_pins
    s = group[0]
    if len(group) == 1 and not pins and _whole_rack(s.spec_gpus, rack):
        # one stage over the whole rack: its usable GPUs beyond its degree are the rest
        return sum(repeat(rack.tdp_w, len(s.usable) - s.degree))
    boosted: set[GpuKey] = set()
    for s in group:
        boosted.update(filterfalse(pins.__contains__, s.used) if pins else s.used)
    # the boosted GPUs are skipped in C: a reduced stage boosts all but a few of its rack's
    return sum(
        pinned_w(rack, pins[g], g) if g in pins else rack.tdp_w
        for g in filterfalse(boosted.__contains__, rack.gpus)
        if cluster.usable(g)
    )


def _whole_rack(gpus: tuple[GpuKey, ...], rack: RackInfo) -> bool:
    return gpus is rack.gpus or gpus == rack.gpus


def water_level(wants: list[float], counts: list[int], available_w: float) -> float:
    """The largest whole-watt level L with sum(n * min(want, L)) <= available (inf when
    every wish fits)."""
    remaining_n = sum(counts)
    remaining_w = available_w
    for want, n in sorted(zip(wants, counts, strict=True)):
        if remaining_n == 0:
            break
        if want * remaining_n <= remaining_w + 1e-6:
            remaining_w -= want * n
            remaining_n -= n
        else:
            return math.floor(remaining_w / remaining_n + 1e-9)
    return math.inf


def gpu_caps(stage: StageDraft, pins: Mapping[GpuKey, float]) -> Mapping[GpuKey, float]:
    """Caps of the stage's used GPUs that differ from TDP (boosted or pinned); without
    pins, the stage's uniform boost (no per-GPU work)."""
    rack = stage.rack
    if not pins:
        return {} if stage.cap_w is None else UniformCaps(stage.used, stage.cap_w)
    caps = {} if stage.cap_w is None else dict.fromkeys(stage.used, stage.cap_w)
    if pins:
        for g in pins.keys() & set(stage.used):
            caps[g] = pinned_w(rack, pins[g], g)
    return {g: w for g, w in caps.items() if w != rack.tdp_w}


def plain_stage_speed(stage: StageDraft, model: PowerModel | Curve) -> float:
    """``stage_speed`` of a stage without power pins or slow GPUs in the cluster: its
    uniform boost's throughput (1.0 at TDP)."""
    return 1.0 if stage.cap_w is None else model.throughput(stage.cap_w / stage.rack.tdp_w)


def stage_speed(
    stage: StageDraft,
    caps: Mapping[GpuKey, float],
    speeds: Mapping[GpuKey, float],
    model: PowerModel | Curve,
    pins: Mapping[GpuKey, float],
) -> float:
    """Relative speed of the stage's slowest used GPU (TP is synchronous): its own speed
    times the model's throughput at its cap. ``caps`` holds the non-TDP caps only."""
    tdp = stage.rack.tdp_w
    # without pins every cap of the stage is its uniform boost (gpu_caps)
    watts = (stage.cap_w,) if caps and not pins else set(caps.values())
    at_cap = {w: model.throughput(w / tdp) for w in watts}
    slowest = min(at_cap.values()) if len(caps) == stage.degree else min([1.0, *at_cap.values()])
    if speeds:
        for g in speeds.keys() & set(stage.used):
            slowest = min(slowest, speeds[g] * at_cap.get(caps.get(g, tdp), 1.0))
    return slowest
