"""A cohort's summary: ``summary.csv``, ``summary.json`` and ``summary.html`` in its output folder, a row per
study (done, failed or waiting) and, on the page, the distributions of held-out PSNR, mean Dice and seconds per
study as small inline SVG histograms (the page loads nothing from elsewhere). Each file is replaced whole,
so a reader never sees half of one; the runner rewrites them every time a study finishes."""

from __future__ import annotations

import csv
import html
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import strict_json
from ..files import write_text

#: The summary's columns, in order; a study's Dice per structure follows as ``dice_<structure>``.
COLUMNS = ("name", "status", "psnr", "ssim", "dice_mean", "seconds", "train_seconds", "host", "device", "study",
           "error", "finished")
#: The distributions the page draws: record key, title, unit.
HISTOGRAMS = (("psnr", "held-out PSNR", "dB"), ("dice_mean", "mean Dice", ""), ("seconds", "time per study", "s"))


def write_summary(out: str | Path, rows: Sequence[dict[str, Any]], progress: dict[str, Any]) -> list[Path]:
    """Write the three files for ``rows`` (one record per study, in the list's order) and the run's
    ``progress`` (counts, seconds, estimate); returns their paths."""
    out = Path(out)
    structures = sorted({name for row in rows for name in (row.get("dice") or {})})
    columns = [*COLUMNS, *(f"dice_{name}" for name in structures)]
    table = io.StringIO()
    writer = csv.DictWriter(table, columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({**{key: _cell(row.get(key)) for key in COLUMNS},
                         **{f"dice_{name}": _cell((row.get("dice") or {}).get(name)) for name in structures}})
    return [write_text(out / "summary.csv", table.getvalue()),
            write_text(out / "summary.json", strict_json.dumps({"progress": progress, "studies": list(rows)},
                                                               indent=2) + "\n"),
            write_text(out / "summary.html", summary_page(rows, progress))]


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if not math.isfinite(value) else f"{value:.6g}"
    return "" if value is None else value


def summary_page(rows: Sequence[dict[str, Any]], progress: dict[str, Any]) -> str:
    """The HTML page: the run's progress, a histogram per figure over the studies done, a row per study."""
    done = [row for row in rows if row.get("status") == "done"]
    figures = "".join(histogram_svg([row.get(key) for row in done], title, unit) for key, title, unit in HISTOGRAMS)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ("study", "status", "PSNR dB", "SSIM", "mean Dice",
                                                           "seconds", "host", "error"))
    body = "".join(
        f"<tr class=\"{html.escape(str(row.get('status')))}\"><td>{html.escape(str(row.get('name')))}</td>"
        f"<td>{html.escape(str(row.get('status')))}</td>"
        + "".join(f"<td class=n>{_shown(row.get(key), spec)}</td>" for key, spec in
                  (("psnr", ".2f"), ("ssim", ".4f"), ("dice_mean", ".3f"), ("seconds", ".1f")))
        + f"<td>{html.escape(str(row.get('host') or ''))}</td><td>{html.escape(str(row.get('error') or ''))}</td>"
          "</tr>" for row in rows)
    state = html.escape(progress_line(progress))
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>cohort summary</title><style>"
            "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}td,th{padding:2px 8px;"
            "border-bottom:1px solid #ddd;text-align:left}td.n{text-align:right}tr.failed td{color:#a00}"
            "figure{display:inline-block;margin:0 1.5em 1em 0}</style></head><body>"
            f"<h1>Cohort</h1><p>{state}</p><div>{figures}</div>"
            f"<table><tr>{head}</tr>{body}</table></body></html>\n")


def _shown(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else ""


def histogram_svg(values: Sequence[Any], title: str, unit: str, bins: int = 12) -> str:
    """A histogram of the finite ``values`` as an inline SVG figure (its caption says how many and the range)."""
    finite = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    width, height = 240, 90
    caption = f"{title}: no studies yet"
    bars = ""
    if finite:
        low, high = min(finite), max(finite)
        span = max(high - low, 1e-3 * max(abs(high), 1.0))  # values equal but for rounding share one bar
        counts = [0] * bins
        for value in finite:
            counts[min(bins - 1, int((value - low) / span * bins))] += 1
        step = width / bins
        tallest = max(counts)
        bars = "".join(f"<rect x=\"{i * step + 1:.1f}\" y=\"{height - count / tallest * height:.1f}\" "
                       f"width=\"{step - 2:.1f}\" height=\"{count / tallest * height:.1f}\" fill=\"#4a7ab5\">"
                       f"<title>{count}</title></rect>" for i, count in enumerate(counts) if count)
        suffix = f" {unit}" if unit else ""
        caption = f"{title}: {len(finite)} studies, {low:.3g} to {high:.3g}{suffix}, median {_median(finite):.3g}"
    return (f"<figure><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" "
            f"role=\"img\" aria-label=\"{html.escape(title)}\">{bars}</svg>"
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def progress_line(progress: dict[str, Any]) -> str:
    """``12 of 40 done (3 skipped), 1 failed, 4 running; 8 min left`` from the runner's progress dict."""
    skipped = f" ({progress['skipped']} skipped)" if progress.get("skipped") else ""
    left = progress.get("seconds_left")
    estimate = "" if progress.get("running", 0) == 0 and progress.get("waiting", 0) == 0 else (
        "; time left: estimating" if left is None else f"; about {format_seconds(left)} left")
    return (f"{progress.get('done', 0)} of {progress.get('total', 0)} done{skipped}, {progress.get('failed', 0)} "
            f"failed, {progress.get('running', 0)} running, {progress.get('waiting', 0)} waiting; "
            f"{format_seconds(progress.get('elapsed', 0.0))} so far{estimate}")


def format_seconds(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.2 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
