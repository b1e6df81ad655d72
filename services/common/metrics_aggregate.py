"""One /metrics page for a whole stack: scrape each process's page, label every sample with
the process it came from, and merge families so each appears once (Prometheus rejects a page
that declares a family twice).

The text handling is pure (`parse_exposition`, `add_labels`, `merge_pages`); `Aggregator` adds
the HTTP reads.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.metrics import escape_help, format_labels
from services.common.metrics_http import MetricsServer, start_metrics_server

_SAMPLE_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# Sample names that belong to a family of the given type besides the family name itself.
_SUFFIXES = {
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}
# Labels the aggregator adds; a process's own label of the same name is kept as exported_<name>.
TARGET_LABELS = ("service", "instance")


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    service: str
    """tokenizer, scheduler or worker."""
    instance: str
    """The process's name in the stack (tokenizer-0, scheduler, ...)."""
    url: str


@dataclass(slots=True)
class Family:
    name: str
    type: str = "untyped"
    help: str | None = None
    """As written on the page (already escaped)."""
    samples: list[str] = field(default_factory=list)

    def owns(self, sample_name: str) -> bool:
        if sample_name == self.name:
            return True
        suffixes = _SUFFIXES.get(self.type, ())
        return any(sample_name == self.name + suffix for suffix in suffixes)


# ---- parsing ------------------------------------------------------------------------------


def parse_exposition(text: str) -> list[Family]:
    """A page in text format 0.0.4 → its families in page order. Samples go to the family
    whose HELP/TYPE came last if their name belongs to it, else to an untyped family."""
    families: dict[str, Family] = {}
    current: Family | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                current = families.setdefault(parts[2], Family(parts[2]))
                value = parts[3] if len(parts) == 4 else ""
                if parts[1] == "HELP":
                    current.help = value
                else:
                    current.type = value
            continue  # other comments carry nothing
        match = _SAMPLE_NAME.match(line)
        if match is None:
            continue
        name = match.group(0)
        if current is None or not current.owns(name):
            current = families.setdefault(name, Family(name))
        current.samples.append(line)
    return list(families.values())


def _split_sample(line: str) -> tuple[str, list[tuple[str, str]], str]:
    """'name{a="x"} 1 123' → ('name', [('a', 'x')], ' 1 123'); values stay escaped."""
    match = _SAMPLE_NAME.match(line)
    if match is None:
        raise ValueError(f"not a sample line: {line!r}")
    name, index = match.group(0), match.end()
    labels: list[tuple[str, str]] = []
    if index < len(line) and line[index] == "{":
        index += 1
        while True:
            while index < len(line) and line[index] in " ,":
                index += 1
            if index >= len(line):
                raise ValueError(f"unterminated labels: {line!r}")
            if line[index] == "}":
                index += 1
                break
            equals = line.index("=", index)
            label = line[index:equals].strip()
            if line[equals + 1] != '"':
                raise ValueError(f"unquoted label value: {line!r}")
            index = equals + 2
            start = index
            while line[index] != '"':
                index += 2 if line[index] == "\\" else 1
            labels.append((label, line[start:index]))
            index += 1
    return name, labels, line[index:]


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def add_labels(line: str, extra: Sequence[tuple[str, str]]) -> str:
    """The sample line with `extra` labels first; a label the sample already has under one of
    those names is renamed exported_<name> (as Prometheus does with honor_labels off)."""
    name, labels, rest = _split_sample(line)
    taken = {label for label, _ in extra}
    own = [
        (f"exported_{label}" if label in taken else label, _unescape(value))
        for label, value in labels
    ]
    return f"{name}{format_labels([*extra, *own])}{rest}"


# ---- merging ------------------------------------------------------------------------------


def merge_pages(pages: Sequence[tuple[Sequence[tuple[str, str]], str]]) -> str:
    """(labels to add, page text) per process → one page, each family once.

    The first page to declare a family gives its HELP and TYPE; samples from a page that
    declares the same name with another type are dropped (they could not be queried as one).
    """
    merged: dict[str, Family] = {}
    for extra, text in pages:
        for family in parse_exposition(text):
            target = merged.setdefault(family.name, Family(family.name, family.type, family.help))
            if target.type != family.type:
                continue
            if target.help is None:
                target.help = family.help
            target.samples.extend(add_labels(sample, extra) for sample in family.samples)
    lines: list[str] = []
    for family in merged.values():
        if family.help is not None:
            lines.append(f"# HELP {family.name} {family.help}".rstrip())
        lines.append(f"# TYPE {family.name} {family.type}")
        lines.extend(family.samples)
    return "\n".join(lines) + "\n" if lines else ""


SCRAPE_UP = "llmserve_scrape_up"


class Aggregator:
    """Scrapes every target on each call; a process that does not answer is left out of the
    page and shows as llmserve_scrape_up 0."""

    def __init__(self, targets: Sequence[ScrapeTarget], timeout_s: float = 2.0) -> None:
        self.targets = list(targets)
        self.timeout_s = timeout_s

    def render(self) -> str:
        pages: list[tuple[Sequence[tuple[str, str]], str]] = []
        up: list[str] = []
        for target in self.targets:
            labels = [("service", target.service), ("instance", target.instance)]
            text = self._scrape(target.url)
            if text is not None:
                pages.append((labels, text))
            up.append(f"{SCRAPE_UP}{format_labels(labels)} {1.0 if text is not None else 0.0}")
        own = "\n".join(
            [
                f"# HELP {SCRAPE_UP} "
                + escape_help("1 when the launcher could read the process's /metrics, else 0."),
                f"# TYPE {SCRAPE_UP} gauge",
                *up,
            ]
        )
        return merge_pages([((), own), *pages])

    def _scrape(self, url: str) -> str | None:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                return str(response.read().decode("utf-8"))
        except OSError:  # refused (restarting), timed out, HTTP error
            return None


def start_aggregate_server(
    host: str, port: int | None, targets: Sequence[ScrapeTarget]
) -> MetricsServer | None:
    """The stack's /metrics on host:port (0 = any free port), or None when `port` is None."""
    return start_metrics_server(Aggregator(targets).render, host, port, "stack")
