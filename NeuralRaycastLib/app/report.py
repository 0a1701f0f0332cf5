"""The demo's ``report.html``: one self-contained page (pictures next to it in the output folder) with
reference and neural renders side by side, error maps, a turntable, the G-buffer, loss and PSNR curves
(inline SVG), the metrics, timings, device and versions. Every file is written atomically (files.py): a
failed write leaves the earlier file, or none, never a half-written one."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..files import atomic_file, write_text
from ..render.metrics import save_png
from ..train.evaluate import shown

NOTE = ("The built-in sample is real anatomy (the ICBM 2009a template) with a synthetic lesion and synthetic "
        "contrasts; it shows what the software does, not how it performs on patients.")


def error_picture(a: np.ndarray, b: np.ndarray, scale: float = 0.25) -> np.ndarray:
    """|a − b| (mean over colour) as a black-red-yellow-white heat map, saturating at ``scale``."""
    e = np.clip(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).mean(axis=-1) / scale, 0.0, 1.0)
    return np.stack([np.clip(3 * e, 0, 1), np.clip(3 * e - 1, 0, 1), np.clip(3 * e - 2, 0, 1)], axis=-1)


def save_gif(frames: list[np.ndarray], path: Path, seconds_per_frame: float = 0.12) -> Path:
    from PIL import Image

    from ..render.metrics import to_uint8

    images = [Image.fromarray(to_uint8(frame)) for frame in frames]
    with atomic_file(path) as handle:
        images[0].save(handle, format="GIF", save_all=True, append_images=images[1:],
                       duration=int(seconds_per_frame * 1000), loop=0)
    return path


def svg_curves(series: dict[str, list[tuple[float, float]]], title: str, y_label: str, log_y: bool = False,
               width: int = 520, height: int = 260) -> str:
    """A small line chart of (x, y) series as inline SVG (no plotting library needed)."""
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    points = [(x, y) for values in series.values() for x, y in values if np.isfinite(y) and (y > 0 or not log_y)]
    if not points:
        return f"<p>{html.escape(title)}: no data</p>"
    xs = [p[0] for p in points]
    ys = [np.log10(p[1]) if log_y else p[1] for p in points]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(ys), max(max(ys), min(ys) + 1e-6)
    left, right, top, bottom = 56, 12, 24, 36

    def to_px(x: float, y: float) -> tuple[float, float]:
        y = np.log10(y) if log_y else y
        return (left + (x - x0) / (x1 - x0) * (width - left - right),
                height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom))

    parts = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" font-size="11">',
             f'<text x="{width / 2}" y="14" text-anchor="middle" font-weight="bold">{html.escape(title)}</text>',
             f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="#888"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#888"/>']
    for value in np.linspace(y0, y1, 4):
        label = f"{10 ** value:.3g}" if log_y else f"{value:.3g}"
        y = height - bottom - (value - y0) / (y1 - y0) * (height - top - bottom)
        parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    parts.append(f'<text x="{(left + width) / 2}" y="{height - 6}" text-anchor="middle">step</text>')
    parts.append(f'<text x="12" y="{(top + height) / 2}" transform="rotate(-90 12 {(top + height) / 2})" '
                 f'text-anchor="middle">{html.escape(y_label)}</text>')
    for index, (name, values) in enumerate(series.items()):
        colour = colours[index % len(colours)]
        usable = [(x, y) for x, y in values if np.isfinite(y) and (y > 0 or not log_y)]
        if not usable:
            continue
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in (to_px(x, y) for x, y in usable))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}"/>')
        parts.append(f'<text x="{width - right - 4}" y="{top + 14 * (index + 1)}" text-anchor="end" '
                     f'fill="{colour}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _table(rows: list[list[Any]], header: list[str]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _live_view(page: str | None) -> str:
    """The shared page (app/share.py) in a frame where the browser offers WebGPU; elsewhere a message saying so,
    above the turntable that stands in for it."""
    if not page:
        return ""
    name = html.escape(page)
    return f"""<h2>Live view (the trained field rendered by this browser)</h2>
<div id="live-view" hidden>
<iframe src="{name}" title="live view" style="width:100%;height:560px;border:0"></iframe>
<p>Drag to turn, right-drag or shift-drag to pan, wheel or pinch to zoom; <a href="{name}">{name}</a> opens it
alone.</p>
</div>
<p id="live-missing" class="note">This browser does not offer WebGPU, so the live view cannot run here: the turntable
below shows the trained field instead. Open <a href="{name}">{name}</a> in a browser with WebGPU (a recent Chrome or
Edge, for example) to turn it by hand.</p>
<script>
(function () {{
  if (!navigator.gpu) return;
  navigator.gpu.requestAdapter().then(function (adapter) {{
    if (!adapter) return;
    document.getElementById("live-view").hidden = false;
    document.getElementById("live-missing").hidden = true;
  }}, function () {{}});
}})();
</script>"""


def branch_column(metrics: dict[str, Any], frame_ms: float) -> dict[str, Any]:
    """A branch's figures the report sets side by side, from its ``evaluate`` metrics and a frame's time."""
    return {"heldout_psnr": metrics["heldout_psnr"], "heldout_ssim": metrics["heldout_ssim"],
            "train_seconds": metrics.get("train_seconds"), "frame_ms": frame_ms, "frame_size": metrics["image_size"],
            "model_bytes": metrics["model_bytes"], "dice": dict(metrics["dice"])}


def branches_table(columns: dict[str, dict[str, Any]]) -> str:
    """A column per branch (``branch_column``'s figures), a line per figure; "–" where a branch lacks one."""
    def figure(key: str, form: str, scale: float = 1.0) -> list[str]:
        return [shown(None if column.get(key) is None else column[key] * scale, form) for column in columns.values()]

    sizes = {column["frame_size"] for column in columns.values()}
    rows = [["held-out PSNR (dB)", *figure("heldout_psnr", ".2f")], ["held-out SSIM", *figure("heldout_ssim", ".4f")],
            ["training time (s)", *figure("train_seconds", ".1f")],
            [f"frame time at {'/'.join(f'{size}²' for size in sorted(sizes))} (ms)", *figure("frame_ms", ".1f")],
            ["model (MB)", *figure("model_bytes", ".2f", 1e-6)]]
    structures = dict.fromkeys(name for column in columns.values() for name in column["dice"])
    rows += [[f"Dice {name}", *[shown(column["dice"].get(name), ".3f") for column in columns.values()]]
             for name in structures]
    return _table(rows, ["figure", *columns])


def write_report(folder: Path, context: dict[str, Any]) -> Path:
    """``context``: metrics, log rows, timings, device, versions, pictures (paths relative to ``folder``),
    meshes (name, triangles, file)."""
    metrics, rows = context["metrics"], context["log_rows"]
    curves = {
        "loss": svg_curves({
            "SDF loss (stage 1)": [(r["step"], r["sdf"]) for r in rows if "sdf" in r],
            "image loss (stages 2-3)": [(r["step"], r["loss"]) for r in rows if "loss" in r],
        }, "Training loss", "loss", log_y=True),
        "psnr": svg_curves({"held-out PSNR": [(r["step"], r["heldout_psnr"]) for r in rows if "heldout_psnr" in r]},
                           "Held-out PSNR", "dB"),
    }
    structures = list(metrics["dice"])
    def volumes(name: str) -> list[str]:  # metrics of runs evaluated before volumes were reported lack them
        if "label_volume_ml" not in metrics:
            return ["–", "–", "–", "–"]
        change = metrics["volume_difference_percent"][name]
        return [f"{metrics['label_volume_ml'][name]:.2f}", f"{metrics['learned_volume_ml'][name]:.2f}",
                "–" if change is None else f"{change:+.1f} %",
                f"{metrics['pieces_kept'][name]} of {metrics['label_pieces'][name]}"]

    geometry = _table([[s, f"{metrics['dice'][s]:.3f}", shown(metrics['mean_surface_distance_mm'][s], ".2f"),
                        shown(metrics['hd95_mm'][s], ".2f"), *volumes(s)] for s in structures],
                      ["structure", "Dice", "mean surface distance (mm)", "HD95 (mm)", "label volume (ml)",
                       "learned volume (ml)", "volume difference", "pieces kept"])
    comparisons = "".join(
        f'<figure><img src="{html.escape(p["reference"])}"><img src="{html.escape(p["neural"])}">'
        f'<img src="{html.escape(p["error"])}">' + (f'<img src="{html.escape(p["gaussians"])}">' if "gaussians" in p
                                                   else "")
        + f'<figcaption>view {p["view"]}: reference · neural · |error| (PSNR {p["psnr"]:.2f} dB)'
        + (f' · Gaussians (PSNR {p["gaussians_psnr"]:.2f} dB)' if "gaussians" in p else "")
        + '</figcaption></figure>' for p in context["pictures"]["held_out"])
    branches = context.get("branches", {})
    side_by_side = (f"<h2>Branches side by side</h2><p>Each trained with the {html.escape(metrics['preset'])} preset "
                    f"on the same reference views; figures from each branch's own run folder.</p>"
                    f"{branches_table(branches)}" if len(branches) > 1 else "")
    meshes = _table([[m["name"], m["triangles"], m["file"]] for m in context["meshes"]],
                    ["structure", "triangles", "file"])
    timings = _table([[k, f"{v:.1f} s"] for k, v in context["timings"].items()], ["step", "time"])
    versions = _table([[k, v] for k, v in context["versions"].items()], ["component", "version"])
    gaussian_files = (", <code>gaussians/gaussians.safetensors</code>, <code>gaussians/metrics.json</code>"
                      if "gaussians" in branches else "")
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>SlicerNeuralRaycast demo report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}} img{{margin:2px;
image-rendering:pixelated;max-width:32%}} figure{{margin:1em 0}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}} .note{{background:#fff6dd;padding:.7em}}</style>
</head><body>
<h1>SlicerNeuralRaycast: {html.escape(context["study"])}</h1>
<p class="note">{html.escape(NOTE)}</p>
<h2>Summary</h2>
<p>Held-out PSNR <b>{shown(metrics["heldout_psnr"], ".2f")} dB</b>, SSIM <b>{shown(metrics["heldout_ssim"], ".4f")}</b>
against the reference renderer ({len(context["pictures"]["held_out"])} held-out views of {metrics["image_size"]}²);
trained with the <b>{html.escape(metrics["preset"])}</b> preset in {metrics["train_seconds"]:.1f} s on
{html.escape(str(metrics["device"]))} ({html.escape(metrics["backend"])}); model {metrics["model_bytes"] / 1e6:.2f} MB.
{html.escape(context.get("preset_note", ""))}</p>
{side_by_side}
<h2>Reference and neural renders (held-out views)</h2>{comparisons}
{_live_view(context["pictures"].get("live"))}
<h2>Turntable (neural render)</h2><img src="{html.escape(context["pictures"]["turntable"])}">
<h2>G-buffer (neural render)</h2>
<figure><img src="{html.escape(context["pictures"]["depth"])}"><img src="{html.escape(context["pictures"]["normal"])}">
<figcaption>depth · normal</figcaption></figure>
<h2>Training curves</h2>{curves["loss"]}{curves["psnr"]}
<h2>Geometry against the segmentation</h2>{geometry}
<h2>Meshes of the learned surfaces</h2>{meshes}
<h2>Timings</h2>{timings}
<h2>Device and versions</h2>{versions}
<h2>Files</h2><p><code>metrics.json</code>, <code>run/model.safetensors</code>, <code>run/train_log.json</code>,
<code>run/reference/</code>, <code>meshes/</code>, <code>turntable/</code>{gaussian_files}.</p>
</body></html>
"""
    write_text(folder / "report_context.json", json.dumps(context, indent=1, default=str) + "\n")
    return write_text(folder / "report.html", page)  # last: a report is there only when all it shows is


def save_comparison(folder: Path, view: int, reference: np.ndarray, neural: np.ndarray, psnr_db: float) -> dict:
    names = {kind: f"compare/{view:03d}_{kind}.png" for kind in ("reference", "neural", "error")}
    save_png(reference, folder / names["reference"])
    save_png(neural, folder / names["neural"])
    save_png(error_picture(reference, neural), folder / names["error"])
    return {"view": view, "psnr": psnr_db, **names}
