"""Prometheus metrics without a client library: Counter, Gauge and Histogram with labels, in a
Registry that renders the text exposition format 0.0.4.

Thread-safe: every labelled series has its own lock, held for a few arithmetic operations and
never across I/O, so the step loop and the scrape thread never wait on each other for long.
"""

from __future__ import annotations

import math
import re
import threading
from bisect import bisect_left
from collections.abc import Sequence
from typing import ClassVar, Generic, TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds, from a fast decode step on a GPU to a long request on a CPU.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
# Counts of things per step (sequences, tokens): powers of two.
SIZE_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(14))

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


# ---- text format ------------------------------------------------------------------------


def format_value(value: float) -> str:
    """A sample value or bucket bound as Prometheus writes it: 3.0, 0.25, +Inf, NaN."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_labels(pairs: Sequence[tuple[str, str]]) -> str:
    """'{a="1",b="x"}', or '' without labels."""
    if not pairs:
        return ""
    return "{" + ",".join(f'{name}="{escape_label_value(value)}"' for name, value in pairs) + "}"


# ---- series: one labelled time series each -------------------------------------------------


class _CounterSeries:
    __slots__ = ("_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"a counter only goes up, got inc({amount})")
        with self._lock:
            self._value += amount

    @property
    def value(self) -> float:
        return self._value


class _GaugeSeries:
    __slots__ = ("_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0.0

    def set(self, value: float) -> None:
        with self._lock:  # so a set never interleaves with an inc's read-modify-write
            self._value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value -= amount

    @property
    def value(self) -> float:
        return self._value


class _HistogramSeries:
    """Per-bucket counts (not cumulative: one increment per observation); made cumulative
    when rendered."""

    __slots__ = ("_bounds", "_counts", "_lock", "_sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._lock = threading.Lock()
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value` (e.g. each token of a message that carried several)."""
        index = bisect_left(self._bounds, value)  # first bound >= value: `le` is inclusive
        with self._lock:
            self._counts[index] += count
            self._sum += value * count

    def snapshot(self) -> tuple[list[int], float]:
        """(cumulative counts per bound, +Inf last; sum)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for count in counts:
            running += count
            cumulative.append(running)
        return cumulative, total


# ---- metric families -----------------------------------------------------------------------

S = TypeVar("S", _CounterSeries, _GaugeSeries, _HistogramSeries)


class _Family(Generic[S]):
    """A named metric with fixed label names; one series per combination of label values."""

    kind: ClassVar[str]

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        if not _METRIC_NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        for label in labelnames:
            if not _LABEL_NAME.match(label) or label.startswith("__"):
                raise ValueError(f"invalid label name {label!r} in {name}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"repeated label name in {name}: {labelnames}")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], S] = {}
        if not self.labelnames:
            self._series[()] = self._new_series()

    def _new_series(self) -> S:
        raise NotImplementedError

    def labels(self, *values: str) -> S:
        """The series for these label values (positional, in `labelnames` order)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        key = tuple(str(v) for v in values)
        series = self._series.get(key)
        if series is None:
            with self._lock:
                series = self._series.setdefault(key, self._new_series())
        return series

    def _unlabelled(self) -> S:
        if self.labelnames:
            raise ValueError(f"{self.name} has labels {self.labelnames}: use .labels(...)")
        return self._series[()]

    def render(self) -> list[str]:
        lines = [
            f"# HELP {self.name} {escape_help(self.documentation)}",
            f"# TYPE {self.name} {self.kind}",
        ]
        with self._lock:
            items = list(self._series.items())
        for values, series in items:
            lines.extend(
                self._render_series(list(zip(self.labelnames, values, strict=True)), series)
            )
        return lines

    def _render_series(self, labels: list[tuple[str, str]], series: S) -> list[str]:
        raise NotImplementedError


class Counter(_Family[_CounterSeries]):
    """Only goes up. By convention the name ends in `_total`."""

    kind = "counter"

    def _new_series(self) -> _CounterSeries:
        return _CounterSeries()

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def _render_series(self, labels: list[tuple[str, str]], series: _CounterSeries) -> list[str]:
        return [f"{self.name}{format_labels(labels)} {format_value(series.value)}"]


class Gauge(_Family[_GaugeSeries]):
    kind = "gauge"

    def _new_series(self) -> _GaugeSeries:
        return _GaugeSeries()

    def set(self, value: float) -> None:
        self._unlabelled().set(value)

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._unlabelled().dec(amount)

    def _render_series(self, labels: list[tuple[str, str]], series: _GaugeSeries) -> list[str]:
        return [f"{self.name}{format_labels(labels)} {format_value(series.value)}"]


class Histogram(_Family[_HistogramSeries]):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS_S,
    ) -> None:
        bounds = tuple(float(b) for b in buckets if not math.isinf(b))
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"buckets of {name} must be increasing and unique, got {buckets}")
        if "le" in labelnames:
            raise ValueError(f"{name}: 'le' is reserved for histogram buckets")
        self.bounds = bounds
        super().__init__(name, documentation, labelnames)

    def _new_series(self) -> _HistogramSeries:
        return _HistogramSeries(self.bounds)

    def observe(self, value: float, count: int = 1) -> None:
        self._unlabelled().observe(value, count)

    def _render_series(self, labels: list[tuple[str, str]], series: _HistogramSeries) -> list[str]:
        cumulative, total = series.snapshot()
        lines = [
            f"{self.name}_bucket{format_labels([*labels, ('le', format_value(bound))])} "
            f"{format_value(count)}"
            for bound, count in zip((*self.bounds, math.inf), cumulative, strict=True)
        ]
        lines.append(f"{self.name}_sum{format_labels(labels)} {format_value(total)}")
        lines.append(f"{self.name}_count{format_labels(labels)} {format_value(cumulative[-1])}")
        return lines


F = TypeVar("F", Counter, Gauge, Histogram)


class Registry:
    """The metrics of one process, rendered in registration order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}  # type: ignore[type-arg]

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        if not name.endswith("_total"):
            raise ValueError(f"counter names end in _total, got {name!r}")
        return self._register(Counter(name, documentation, labelnames))

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._register(Gauge(name, documentation, labelnames))

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS_S,
    ) -> Histogram:
        return self._register(Histogram(name, documentation, labelnames, buckets))

    def _register(self, family: F) -> F:
        with self._lock:
            if family.name in self._families:
                raise ValueError(f"metric {family.name} is already registered")
            self._families[family.name] = family
        return family

    def render(self) -> str:
        with self._lock:
            families = list(self._families.values())
        lines = [line for family in families for line in family.render()]
        return "\n".join(lines) + "\n" if lines else ""
