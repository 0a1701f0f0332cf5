"""A benchmark's rows and report (Markdown and JSON), and the timing helpers every suite shares."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class BenchRow:
    suite: str
    metric: str
    value: float
    unit: str
    notes: str = ""
    #: The branch or variant a row measures where a suite compares several (``bench --suite branches``): such
    #: rows are also shown side by side, one column each.
    column: str = ""



@dataclass
class BenchReport:
    date: str
    device: dict
    command: str
    study: str
    rows: list[BenchRow] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def markdown(self) -> str:
        lines = [
            f"### {self.date} · {self.device['adapter']} ({self.device['backend']})",
            "",
            f"Command: `{self.command}`  ",
            f"Study: {self.study}  ",
            f"slangpy {self.device['slangpy_version']}, Python {self.device['python_version']}, "
            f"{platform.system()} {platform.machine()}",
            "",
            "| suite | metric | value | unit | notes |",
            "|---|---|---:|---|---|",
        ]
        def cell(text: str) -> str:
            return text.replace("|", "\\|")  # a metric such as "mean |s - B|" must not split the row

        lines += [f"| {r.suite} | {cell(r.metric + (f' ({r.column})' if r.column else ''))} | {r.value:.4g} | "
                  f"{r.unit} | {cell(r.notes)} |" for r in self.rows]
        for suite in dict.fromkeys(r.suite for r in self.rows if r.column):
            lines += ["", side_by_side([r for r in self.rows if r.suite == suite and r.column]).rstrip("\n")]
        return "\n".join(lines) + "\n"


def side_by_side(rows: list[BenchRow]) -> str:
    """Rows that name a column as a Markdown table with a column each and a line per metric, in the rows'
    order, so that a figure of one branch sits beside the other's; a figure a column lacks shows "–"."""
    columns = list(dict.fromkeys(r.column for r in rows))
    table: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        table.setdefault((r.metric, r.unit), {})[r.column] = r.value

    def shown(value: float | None) -> str:
        return "–" if value is None else "n/a" if not np.isfinite(value) else f"{value:.4g}"

    lines = ["| figure | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for (metric, unit), values in table.items():
        name = (metric + (f" ({unit})" if unit else "")).replace("|", "\\|")
        lines.append(f"| {name} | " + " | ".join(shown(values.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"



def timed_each(function: Callable[[], object], min_seconds: float, max_repeats: int) -> list[float]:
    """Seconds of each of repeated calls (at least one, until ``min_seconds`` in all or ``max_repeats``)."""
    seconds: list[float] = []
    while not seconds or (sum(seconds) < min_seconds and len(seconds) < max_repeats):
        start = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - start)
    return seconds



def timed(function: Callable[[], object], min_seconds: float, max_repeats: int) -> tuple[float, int]:
    """Seconds per call over repeated calls, and how many (as :func:`timed_each` repeats them)."""
    seconds = timed_each(function, min_seconds, max_repeats)
    return sum(seconds) / len(seconds), len(seconds)



def frame_notes(seconds: list[float]) -> str:
    """How a row's repeated frames spread: the mean (the row's value) is pulled up by single slow frames, which
    the median is not."""
    if len(seconds) == 1:
        return "1 run incl. read-back"
    return (f"{len(seconds)} runs incl. read-back: median {1e3 * float(np.median(seconds)):.2f} ms, "
            f"fastest {1e3 * min(seconds):.2f} ms, slowest {1e3 * max(seconds):.2f} ms")
