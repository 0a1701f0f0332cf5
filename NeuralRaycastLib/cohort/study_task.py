"""One study of a cohort, as a task a worker runs: train it into ``OUT/studies/<name>/`` whole or not at all.

The study's folder is built beside its place and renamed into it once it holds everything: the run folder that
:func:`~NeuralRaycastLib.train.run.train_study` writes, ``metrics.json``, the meshes asked for, and last
``study.json`` (this task's record). A worker killed mid-study leaves at most a ``.partial-`` folder, which the
next run of the cohort removes; a study whose folder exists is done and is skipped. A study that fails leaves
``OUT/failed/<name>/error.json`` (its one-line message, the traceback, the host) and the cohort goes on; the
next run tries it again and removes that record once it succeeds.

Everything is addressed by path under OUT, which may be shared storage that every worker sees.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import strict_json
from ..files import PARTIAL, REPLACED, StagedFolder, atomic_folder, write_text
from .tasks import StudyTask

try:  # advisory file locks; where there are none, each task warms up on its own
    import fcntl
except ImportError:  # pragma: no cover - not on the platforms cohorts run on
    fcntl = None

STUDIES, FAILED, GENERATED = "studies", "failed", "generated"
RECORD, ERROR = "study.json", "error.json"


@dataclass(frozen=True)
class FitOptions:
    """How every study of a cohort is trained (the ``fit`` command's options), sent to each task."""

    preset: str | None = None
    iterations: int | None = None
    views: int | None = None
    size: int | None = None
    max_voxels: int | None = None
    seed: int = 0
    device: str | None = None
    gpu_memory: str | None = None  # each study's budget (several share a GPU where they fit)
    meshes: tuple[str, ...] = ()  # formats of the learned surfaces' meshes, written to meshes/
    warm_up: bool = True


def study_folder(out: str | Path, name: str) -> Path:
    return Path(out) / STUDIES / name


def failure_folder(out: str | Path, name: str) -> Path:
    return Path(out) / FAILED / name


def finished_record(out: str | Path, name: str) -> dict[str, Any] | None:
    """The record of a study already trained into ``out`` (its folder exists only once complete), else None."""
    try:
        record = json.loads((study_folder(out, name) / RECORD).read_text())
    except (OSError, ValueError):  # none, or unreadable: trained again, which replaces the folder
        return None
    return record if isinstance(record, dict) and record.get("status") == "done" else None


def remove_leftovers(out: str | Path, names: set[str]) -> list[Path]:
    """Remove what killed workers left of these studies (staging and replaced folders); returns them. Only the
    one cohort run that holds the output's lock calls this, so no live task's folder is among them."""
    removed = []
    for folder in (Path(out) / kind for kind in (STUDIES, FAILED, GENERATED)):
        for path in folder.iterdir() if folder.is_dir() else ():
            for marker in (PARTIAL, REPLACED):
                stem, found, _ = path.name.partition(marker)
                if found and stem in names:
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
    return removed


def run_study(task: StudyTask, out: str, options: FitOptions,
              describe: Callable[[BaseException], str] | None = None) -> dict[str, Any]:
    """Train ``task``'s study into ``out`` (see the module docstring) and return its record: ``status`` is
    ``done`` (with its scores and seconds) or ``failed`` (with ``error``, the one line ``describe`` makes of the
    exception, as the command line says it). A study already done is not trained again (``reused``). Only an
    interrupt or the process's end escapes."""
    began = time.time()
    done = finished_record(out, task.name)
    if done is not None:
        return {**done, "reused": True}
    try:
        record = _train(task, out, options, began)
    except Exception as error:  # the study's own failure: recorded, and the cohort goes on
        if (done := finished_record(out, task.name)) is not None:  # another attempt finished it meanwhile
            return {**done, "reused": True}
        message = (describe or one_line)(error)
        return record_failure(out, task, message, traceback.format_exc(), time.time() - began)
    shutil.rmtree(failure_folder(out, task.name), ignore_errors=True)
    return record


def record_failure(out: str | Path, task: StudyTask, message: str, details: str, seconds: float) -> dict[str, Any]:
    """Write ``OUT/failed/<name>/error.json`` (whole) and return the failed study's record."""
    record = {**_base_record(task), "status": "failed", "error": message, "seconds": round(seconds, 3),
              "finished": _now()}
    folder = failure_folder(out, task.name)
    try:
        with atomic_folder(folder, lambda path: (path / ERROR).is_file()) as staging:
            write_text(staging / ERROR, strict_json.dumps({**record, "traceback": details}, indent=2) + "\n")
    except OSError as error:  # the record is still returned to the summary
        record["error"] = f"{message} (its error record could not be written: {one_line(error)})"
    return record


def _train(task: StudyTask, out: str, options: FitOptions, began: float) -> dict[str, Any]:
    from ..gpu.device import open_device
    from ..train.presets import RunSettings
    from ..train.run import train_study
    from ..train.run_folder import run_metrics

    gpu = open_device(options.device, options.gpu_memory)
    study = task.study if task.study is not None else str(generated_study(out, task))
    settings = RunSettings.for_device(gpu, options.preset, seed=options.seed, iterations=options.iterations,
                                      views=options.views, size=options.size, max_voxels=options.max_voxels)
    if options.warm_up:
        warm_up_once(gpu, study, settings)
    # A folder there without a readable record is no finished study (it was altered): it is replaced.
    staged = StagedFolder(study_folder(out, task.name), lambda path: finished_record(out, task.name) is None)
    try:
        run = train_study(gpu, study, staged.path, settings, warm_up=options.warm_up)
        metrics = run_metrics(gpu, staged.path, run.prepared, run.field, run.views, run.settings, run.renderer)
        if options.meshes:
            from ..mesh.mesh import write_meshes

            write_meshes(run.meshes(), staged.path / "meshes", options.meshes)
        record = {**_base_record(task), "status": "done", **_scores(metrics), "seconds": round(time.time() - began, 3),
                  "train_seconds": round(run.log.seconds, 3), "device": gpu.report.adapter,
                  "backend": gpu.backend, "finished": _now()}
        write_text(staged.path / RECORD, strict_json.dumps(record, indent=2) + "\n")  # last: the folder is whole
        staged.commit()
    except BaseException:
        staged.discard()
        raise
    return record


def _scores(metrics: dict[str, Any]) -> dict[str, Any]:
    """The figures of a study's metrics the cohort's summary tabulates."""
    dice = {name: value for name, value in (metrics.get("dice") or {}).items() if value is not None}
    return {"psnr": metrics.get("heldout_psnr"), "ssim": metrics.get("heldout_ssim"),
            "dice_mean": sum(dice.values()) / len(dice) if dice else None, "dice": dice,
            "model_bytes": metrics.get("model_bytes")}


def generated_study(out: str | Path, task: StudyTask) -> Path:
    """The manifest of a generated study, written under ``OUT/generated/<name>/`` on first use (whole)."""
    from ..study.sample import write_sample

    folder = Path(out) / GENERATED / task.name
    manifest = folder / "manifest.json"
    if manifest.is_file():
        return manifest
    options = dict(task.options)
    spacing = options.get("spacing")
    if isinstance(spacing, str):  # a CSV's "1,1,5"
        spacing = tuple(float(part) for part in spacing.split(","))
    with contextlib.suppress(FileExistsError), atomic_folder(folder) as staging:
        write_sample(staging, task.case or "phantom", spacing, int(options.get("seed", 0)),
                     labels_drawn=str(options.get("labels", "clean")))
    return manifest


def warm_up_once(gpu: Any, study: str, settings: Any) -> None:
    """Compile this run's kernels once per machine, not once per task: the first task on a node warms up
    (:func:`~NeuralRaycastLib.train.warmup.ensure_warm`) while holding a lock beside the shader cache; the
    others wait on it and then find the warm-up's stamp. A software device compiles in each run's own process
    (nothing to do here)."""
    if gpu.report.software:
        return
    from ..gpu.device import memory_budget
    from ..train.run_folder import prepare_for_run, study_within_budget
    from ..train.warmup import ensure_warm, needs_warm_up

    loaded, sized = study_within_budget(study, settings, memory_budget(gpu))
    prepared = prepare_for_run(loaded, sized)
    if not needs_warm_up(gpu, prepared, sized):
        return
    with node_lock(Path(gpu.report.shader_cache) / "warm-ups" / "cohort.lock"):
        if needs_warm_up(gpu, prepared, sized):  # not where the task that held the lock before left its stamp
            ensure_warm(gpu, study, prepared, sized)


@contextlib.contextmanager
def node_lock(path: Path, wait: bool = True) -> Iterator[bool]:
    """Hold an advisory lock on ``path`` (created) while the block runs; yields whether it is held (always,
    when ``wait``; without ``wait``, False where another process holds it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        if fcntl is None:
            yield True
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _base_record(task: StudyTask) -> dict[str, Any]:
    return {"name": task.name, "study": task.describe(), "host": socket.gethostname(), "pid": os.getpid()}


def one_line(error: BaseException) -> str:
    """An exception's message on one line (its type's name where it has none)."""
    return " ".join(str(error).split()) or type(error).__name__


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

