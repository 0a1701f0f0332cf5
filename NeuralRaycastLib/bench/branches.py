"""``neuralraycast bench --suite branches``: the signed-distance field and the Gaussians trained on the same
study, reference views and preset, each through the entry point its ``fit`` uses, then read back from its run
folder and scored by its ``evaluate``; the figures come out as rows, one per figure and branch, and as one
table with a column per branch.
"""

from __future__ import annotations

import gc
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..gpu.device import GpuContext, device_memory_in_use
from ..progress import Progress
from ..train.phases import PhaseClock
from ..train.presets import RunSettings
from .report import BenchRow, frame_notes, timed_each

SUITE = "branches"
BRANCHES = ("field", "gaussians")
#: The order the suite trains them in: the device's heap keeps the pages of the buffers a branch lets go, so the
#: branch that needs less goes first and each peak is read above the memory in use before the first.
RUN_ORDER = ("gaussians", "field")
#: The figures per structure, as ``evaluate`` names them, and how a row names them.
STRUCTURE_FIGURES = (("dice", "Dice", ""), ("mean_surface_distance_mm", "mean surface distance", "mm"),
                     ("hd95_mm", "HD95", "mm"))


@dataclass
class BranchResult:
    """What one branch's run gave: its ``evaluate`` figures and what the bench timed around them."""

    branch: str
    metrics: dict[str, Any]  # evaluate's figures of the saved run folder
    fit_seconds: float  # the whole fit: reference views, training, structure weights, saving
    frames: dict[int, list[float]]  # seconds of each timed frame, by the square picture's side
    first_frames: dict[int, float]  # the first frame of each size, timed apart (it may compile)
    live_frames: dict[int, float]  # milliseconds a frame of the live view (frame-rate's), by the picture's side
    peaks: dict[str, int | None]  # largest sample of GPU memory in use per phase, above the branch's start


def bench_settings(gpu: GpuContext, quick: bool) -> RunSettings:
    """Both branches' settings: the standard preset, or on a slow device the quick one with 8 views of 64² and
    150 steps each (the Gaussians' quick schedule), so that a CPU runs the suite in minutes."""
    if quick:
        return RunSettings.for_device(gpu, "quick", views=8, size=64, iterations=150).check()
    return RunSettings.for_device(gpu, "standard").check()


def frame_sizes(quick: bool) -> tuple[int, ...]:
    """The square pictures timed: the issue's 512² and 1024², or 128² alone on a slow device."""
    return (128,) if quick else (512, 1024)


def fit_branch(gpu: GpuContext, branch: str, study: Path, folder: Path, settings: RunSettings,
               progress: Progress) -> Any:
    """Train ``branch`` on ``study`` into ``folder`` as ``fit`` does (the field after its kernels' warm-up on a
    GPU); returns the trained run, which renders."""
    if branch == "field":
        from ..train.run import train_study

        return train_study(gpu, study, folder, settings, progress, warm_up=not gpu.report.software)
    if branch == "gaussians":
        from ..gaussians.run import fit_gaussians

        return fit_gaussians(gpu, study, folder, settings, progress)
    raise ValueError(f"unknown branch {branch!r}; choose from {', '.join(BRANCHES)}")


def evaluate_branch(gpu: GpuContext, branch: str, folder: Path, progress: Progress) -> dict[str, Any]:
    """``evaluate`` on the saved run folder: the model read back from its file and scored afresh."""
    if branch == "gaussians":
        from ..gaussians.run import evaluate_gaussian_run

        return evaluate_gaussian_run(gpu, folder, progress)
    from ..train.run_folder import evaluate_run

    return evaluate_run(gpu, folder, progress)


def warm_up_gaussians(gpu: GpuContext, study: Path, folder: Path, settings: RunSettings) -> float:
    """A few Gaussian steps in a throw-away run, so that compiling its kernels is not counted as training (the
    field's warm-up does this for the field); seconds taken."""
    from dataclasses import replace

    from ..gaussians.run import fit_gaussians, gaussian_schedule

    start = time.perf_counter()
    config = replace(gaussian_schedule(settings), steps=2, eval_every=1, structure_steps=2, densify_every=0)
    fit_gaussians(gpu, study, folder, settings, config=config)
    return time.perf_counter() - start


#: What a frame of each branch reads back to the host, for the rows' notes.
READ_BACK = {"field": "colour, depth and normals read back (the field's RenderedImage)",
             "gaussians": "colour, expected depth and the density's normals read back (a RenderedImage)"}


#: Pictures of the live view's orbit a size (as ``neuralraycast frame-rate --frames``), and on a slow device.
LIVE_FRAMES, LIVE_FRAMES_QUICK = 30, 2


def run_branch(gpu: GpuContext, branch: str, study: Path, folder: Path, settings: RunSettings,
               sizes: tuple[int, ...], progress: Progress, quick: bool = True,
               baseline: int | None = None) -> BranchResult:
    """Fit, evaluate and time the pictures of one branch, sampling the GPU memory in use through each phase; its
    peaks are above ``baseline`` (bytes in use; None: those at the branch's start)."""
    from ..render.camera import orbit_cameras
    from ..render.live_view import time_live_view

    gc.collect()  # what an earlier branch left is released before this one's baseline is read
    before = device_memory_in_use(gpu) if baseline is None else baseline
    clock = PhaseClock(lambda: device_memory_in_use(gpu))
    start = time.perf_counter()
    with clock.phase("fit"):
        run = fit_branch(gpu, branch, study, folder, settings, lambda m, f: progress(f"{branch}: fit: {m}", f))
    fit_seconds = time.perf_counter() - start
    frames: dict[int, list[float]] = {}
    first_frames: dict[int, float] = {}
    live_frames: dict[int, float] = {}
    budget, repeats = (0.2, 2) if quick else (3.0, 20)
    with clock.phase("frames"):
        for size in sizes:
            progress(f"{branch}: frames {size}²", 0.0)
            camera = orbit_cameras(run.prepared.bounds, 3, size, size)[1]
            first = time.perf_counter()
            render = run.render  # each branch's own G-buffer, with its read-back
            render(camera)
            first_frames[size] = time.perf_counter() - first
            frames[size] = timed_each(lambda c=camera, r=render: r(c), budget, repeats)
            progress(f"{branch}: live view {size}²", 0.5)
            live = time_live_view(run.render_picture, run.prepared.bounds,
                                  LIVE_FRAMES_QUICK if quick else LIVE_FRAMES, size, size)
            live_frames[size] = live["ms_per_frame"]
    del run
    gc.collect()
    with clock.phase("evaluate"):
        metrics = evaluate_branch(gpu, branch, folder, lambda m, f: progress(f"{branch}: evaluate: {m}", f))
    peaks = {phase.name: None if phase.peak_bytes is None or before is None else phase.peak_bytes - before
             for phase in clock.phases}
    return BranchResult(branch, metrics, fit_seconds, frames, first_frames, live_frames, peaks)


def branch_rows(results: list[BranchResult]) -> list[BenchRow]:
    """The side-by-side figures as rows, each figure once per branch (the row's column), figure by figure."""
    per_branch = {result.branch: _rows_of(result) for result in results}
    names = list(dict.fromkeys(row.metric for rows in per_branch.values() for row in rows))
    return [row for name in names for rows in per_branch.values() for row in rows if row.metric == name]


def _rows_of(result: BranchResult) -> list[BenchRow]:
    """One branch's figures, in the order of the issue's table."""
    metrics, branch = result.metrics, result.branch

    def row(metric: str, value: float | None, unit: str, notes: str = "") -> BenchRow:
        return BenchRow(SUITE, metric, math.nan if value is None else float(value), unit, notes, column=branch)

    views = f"{metrics.get('image_size')}² held-out views, preset {metrics.get('preset')}"
    count = f"; {metrics['gaussians']:,} Gaussians" if "gaussians" in metrics else ""
    rows = [row("held-out PSNR", metrics.get("heldout_psnr"), "dB", views),
            row("held-out SSIM", metrics.get("heldout_ssim"), "", views),
            row("training time", metrics.get("train_seconds"), "s", "the training loop, as its log keeps it"),
            row("fit wall clock", result.fit_seconds, "s",
                "the whole fit: reference views, training, structure weights or meshes, saving")]
    for size, seconds in result.frames.items():
        mean = sum(seconds) / len(seconds)
        rows.append(row(f"frame time {size}²", 1e3 * mean, "ms",
                        f"{frame_notes(seconds)}; first {result.first_frames[size]:.2f} s; "
                        f"{READ_BACK.get(branch, 'read back')}"))
    for size, ms in result.live_frames.items():
        rows.append(row(f"live view frame {size}²", ms, "ms",
                        "neuralraycast frame-rate's: a camera orbiting the study, one picture a step of the turn, "
                        "packed on the device and a word a pixel read back; the mean"))
    peak = result.peaks.get("fit")
    others = ", ".join(f"{name} {value / 2**30:.2f} GiB" for name, value in result.peaks.items()
                       if value is not None and name != "fit")
    rows.append(row("peak GPU memory while fitting", None if peak is None else peak / 2**30, "GiB",
                    "not readable on this device (CUDA only)" if peak is None else
                    f"largest sample above the memory in use before the suite's first branch; {others}"))
    size = metrics.get("model_bytes")
    rows.append(row("model size", None if size is None else size / 1e6, "MB",
                    f"the run folder's model file, {size:,} bytes{count}"))
    for name in metrics.get("dice", {}):
        for key, label, unit in STRUCTURE_FIGURES:
            rows.append(row(f"{name}: {label}", metrics.get(key, {}).get(name), unit))
    return rows


def bench_branches(gpu: GpuContext, prepared, quick: bool, progress) -> list[BenchRow]:
    """Both branches trained on the bench's study with the same preset (``quick``: the quick preset, small
    views, 128² frames), one after the other in this process (RUN_ORDER), their peaks of GPU memory above what
    was in use before the first; a branch that fails is a row saying why, and the other's figures still come."""
    from ..study.study import write_study

    settings = bench_settings(gpu, quick)
    results, failed = [], []
    warm_up = "no warm-up on a software device: each branch compiles in its first steps"
    gc.collect()
    baseline = device_memory_in_use(gpu)
    with tempfile.TemporaryDirectory(prefix="neuralraycast-branches-") as work:
        study = write_study(prepared.study, Path(work) / "study")
        for branch in RUN_ORDER:
            try:
                if branch == "gaussians" and not gpu.report.software:
                    seconds = warm_up_gaussians(gpu, study, Path(work) / "warm-up", settings)
                    warm_up = f"the Gaussians' kernels compiled first, in a throw-away run of 2 steps: {seconds:.1f} s"
                results.append(run_branch(gpu, branch, study, Path(work) / branch, settings, frame_sizes(quick),
                                          progress, quick, baseline))
                progress(f"{branch}: done: {summary(results[-1])}", 1.0)  # in the log even if a later part fails
            except Exception as error:  # one branch's failure must not lose the other's figures
                failed.append(BenchRow(SUITE, f"{branch}: failed", math.nan, "", " ".join(str(error).split())[:200]))
    steps = f", {settings.iterations} steps each" if settings.iterations else ", each branch's own steps"
    note = BenchRow(SUITE, "settings", settings.size, "px", f"preset {settings.preset}, {settings.views} views of "
                    f"{settings.size}²{steps}, one held out in {settings.held_out_every}; {warm_up}")
    results.sort(key=lambda result: BRANCHES.index(result.branch))
    return [note] + branch_rows(results) + failed


def summary(result: BranchResult) -> str:
    """One line of a branch's main figures, for the progress log."""
    from ..train.evaluate import shown

    metrics = result.metrics
    frames = ", ".join(f"{size}² {1e3 * sum(seconds) / len(seconds):.2f} ms" for size, seconds in result.frames.items())
    live = ", ".join(f"{size}² {ms:.2f} ms" for size, ms in result.live_frames.items())
    dice = ", ".join(f"{name} {shown(value, '.3f')}" for name, value in metrics.get("dice", {}).items())
    return (f"held-out {shown(metrics.get('heldout_psnr'), '.2f')} dB, SSIM {shown(metrics.get('heldout_ssim'), '.4f')}"
            f", training {shown(metrics.get('train_seconds'), '.1f')} s, fit {result.fit_seconds:.1f} s, frames "
            f"{frames}, live view {live}, model {metrics.get('model_bytes', 0) / 1e6:.2f} MB, Dice {dice}")
