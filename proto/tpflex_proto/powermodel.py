"""Power -> throughput model shared by the planner and the simulated GPU backend (pure).

Table-driven, piecewise linear between points of (power ratio, throughput ratio), both
relative to the GPU's TDP and its throughput at TDP. Defaults from the NTP paper
(DESIGN.md): 1.1x power -> 1.069x throughput, 1.2x -> 1.122x. Beyond 1.2x the paper gives
no figure; we extend the observed diminishing return (+0.069, then +0.053 per +0.1x) by
one more step of +0.040 at 1.3x, the boost ceiling (+30% of TDP). Below 1.0x throughput
is taken as falling linearly with power down to the table's first point.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_POINTS: tuple[tuple[float, float], ...] = (
    (0.5, 0.5),
    (1.0, 1.0),
    (1.1, 1.069),
    (1.2, 1.122),
    (1.3, 1.162),
)
DEFAULT_MAX_BOOST = 0.30  # at most +30% of TDP


@dataclass(frozen=True)
class PowerModel:
    points: tuple[tuple[float, float], ...] = DEFAULT_POINTS
    max_boost: float = DEFAULT_MAX_BOOST

    def __post_init__(self) -> None:
        _validate(self.points)
        if not 0 <= self.max_boost <= self.points[-1][0] - 1.0 + 1e-12:
            raise ValueError(
                f"max_boost {self.max_boost} must be within the table (up to "
                f"{self.points[-1][0] - 1.0:.2f})"
            )

    @property
    def max_power_ratio(self) -> float:
        return 1.0 + self.max_boost

    def throughput(self, power_ratio: float) -> float:
        """Relative throughput at ``power_ratio`` x TDP (clamped to the table's range)."""
        xs = [p for p, _ in self.points]
        x = min(max(power_ratio, xs[0]), xs[-1])
        i = bisect_left(xs, x)
        if i == 0:
            return self.points[0][1]
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def power_for(self, throughput_ratio: float) -> float | None:
        """The smallest power ratio that reaches ``throughput_ratio``, or None if even the
        table's maximum does not."""
        ys = [t for _, t in self.points]
        if throughput_ratio > ys[-1] + 1e-12:
            return None
        y = max(throughput_ratio, ys[0])
        i = bisect_left(ys, y)
        if i == 0:
            return self.points[0][0]
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return x0 + (x1 - x0) * (y - y0) / (y1 - y0)


def _validate(points: Sequence[tuple[float, float]]) -> None:
    if len(points) < 2:
        raise ValueError("a power model needs at least two points")
    if not any(abs(p - 1.0) < 1e-12 and abs(t - 1.0) < 1e-12 for p, t in points):
        raise ValueError("a power model must contain the point (1.0, 1.0)")
    for (p0, t0), (p1, t1) in zip(points, points[1:], strict=False):
        if not (p1 > p0 and t1 > t0):
            raise ValueError("power model points must increase strictly in power and throughput")


DEFAULT_POWER_MODEL = PowerModel()
