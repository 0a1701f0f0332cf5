"""Run folders: what a training wrote, read back, rendered, scored and exported.

A run folder holds ``run.json`` (what was trained on and how: the study's file, if any, and the
:class:`~NeuralRaycastLib.train.presets.RunSettings`), ``model.safetensors``, ``train_log.json`` (every
logged loss term and held-out score) and ``reference/`` (the reference views used, with their training /
held-out split). :func:`~NeuralRaycastLib.train.run.train_study` writes one, whole or not at all
(``files.py``); a run whose folder cannot be written is kept in the cache's ``recovered`` folder.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import strict_json
from ..field.field import NeuralField
from ..files import FileSet, WriteError, atomic_folder, copy_tree, write_text
from ..gpu.device import GpuContext
from ..gpu.memory_budget import MemoryBudget
from ..mesh.mesh import Mesh, mesh_sdf_grid
from ..paths import cache_folder
from ..progress import Note, Progress
from ..render.camera import Camera
from ..render.image import RenderedImage
from ..render.neural_render import DiffRenderer
from ..render.reference_views import ReferenceViews, render_reference_views
from ..study.cache import load_study_cached
from ..study.device_distance import maps_device
from ..study.preprocess import PreparedStudy, StudyOutline, prepare
from ..study.study import Study, downsample_study, downsampling_note
from .phases import PhaseClock
from .presets import RunSettings, training_schedule
from .trainer import TrainLog, field_renderer, learned_mesh_shadows

RUN_VERSION = 1
#: What to do when a folder to write a run into holds something else.
RUN_FOLDER_REFUSAL = ("a run is written into a new or empty folder, or over an earlier run that holds nothing "
                      "else")


def prepare_for_run(study: Study | str | Path, settings: RunSettings, progress: Progress | None = None,
                    gpu: GpuContext | None = None,
                    with_outline: Callable[[StudyOutline], object] | None = None,
                    before_maps: Callable[[], object] | None = None) -> PreparedStudy:
    """A study (in memory, e.g. read from a Slicer scene, or its file) downsampled as the settings ask (the
    quick preset; ``progress`` is told the grids before and after) and prepared: brain mask, boundary maps,
    tumour probability (their distance transforms on ``gpu`` where it is a hardware GPU or
    $NEURALRAYCAST_DEVICE_MAPS is 1: study/device_distance.py). ``with_outline``, ``before_maps``: see
    :func:`~NeuralRaycastLib.study.preprocess.prepare`."""
    study = downsampled_for_run(study, settings, progress)
    return prepare(study, progress=progress, min_piece_ml=settings.min_piece_ml,
                   keep_small_pieces=settings.keep_small_pieces, gpu=maps_device(gpu), with_outline=with_outline,
                   before_maps=before_maps)


def downsampled_for_run(study: Study | str | Path, settings: RunSettings, progress: Progress | None = None) -> Study:
    """The study (read, where a file) on the grid the settings' voxel limit asks for (``progress`` told the grids
    before and after), or StudyError where that grid would lose a structure: the check a run makes before its
    device takes any work (the same study again where it is already on that grid)."""
    if not isinstance(study, Study):
        study = load_study_cached(study)
    if settings.max_voxels:
        full, study = study, downsample_study(study, settings.max_voxels)
        if study is not full and progress is not None:
            progress(Note(downsampling_note(full, study)), 0.0)
    return study


def study_within_budget(study: Study | str | Path, settings: RunSettings, budget: MemoryBudget,
                        progress: Progress | None = None) -> tuple[Study, RunSettings]:
    """The study (read, where a file) and the settings with a voxel limit under which its volumes fit the GPU
    memory budget (train/memory.py; ``progress`` is told where the limit is the budget's). The limit is kept in
    the run's settings, so the run's study is prepared the same way again wherever it is opened."""
    from .memory import settings_within_budget

    if not isinstance(study, Study):
        study = load_study_cached(study)
    settings, note = settings_within_budget(study, settings, budget)
    if note is not None and progress is not None:
        progress(Note(note), 0.0)
    return study, settings


def reference_views_for_run(gpu: GpuContext, prepared: PreparedStudy, settings: RunSettings,
                            progress: Progress | None = None) -> ReferenceViews:
    return render_reference_views(gpu, prepared, settings.views, settings.size, settings.size,
                                  shadows=settings.shadows, held_out_every=settings.held_out_every,
                                  progress=progress)


@dataclass
class TrainedRun:
    """A trained (or loaded) field with what it needs to render: the prepared study and its renderer."""

    folder: Path
    prepared: PreparedStudy
    field: NeuralField
    renderer: DiffRenderer
    settings: RunSettings
    views: ReferenceViews | None = None  # the reference views trained on (None for a loaded model)
    log: TrainLog | None = None
    phases: PhaseClock | None = None  # where train_study's time and GPU memory went (None for a loaded model)

    def render(self, camera: Camera) -> RenderedImage:
        return self.renderer.render(camera)

    def render_picture(self, camera: Camera) -> np.ndarray:
        """The live view's picture: straight-alpha bytes (H, W, 4), the rows from the bottom, packed on the device."""
        return self.renderer.render_picture(camera)

    @property
    def gpu(self) -> GpuContext:
        """The device the run renders on."""
        return self.renderer.gpu

    def meshes(self, smoothing_iterations: int = 10, decimation: float = 0.0) -> list[Mesh]:
        """One mesh per structure of the learned surfaces s_k = 0, in RAS millimetres (empty meshes kept, so
        indices match the structures)."""
        from .evaluate import learned_distances

        return mesh_sdf_grid(learned_distances(self.field, self.prepared), self.prepared.affine,
                             self.prepared.structures, smoothing_iterations, decimation)


#: What a run folder holds (train_study and evaluate write them). Only a folder holding nothing else is
#: replaced whole by a new run: a file of the user's in it is never deleted.
RUN_ENTRIES = frozenset({"run.json", "model.safetensors", "gaussians.safetensors", "appearance.safetensors",
                         "train_log.json", "metrics.json", "reference"})


def is_run_folder(folder: Path) -> bool:
    """A folder a run was written into and that holds nothing else (one a new run may replace whole)."""
    folder = Path(folder)
    return (folder / "run.json").is_file() and {entry.name for entry in folder.iterdir()} <= RUN_ENTRIES


def model_encoder(gpu: GpuContext, prepared: PreparedStudy, field: NeuralField, log: TrainLog,
                  settings: RunSettings, latent=None) -> Callable[[], dict[str, bytes]]:
    """The run's model files (``model.safetensors``, and ``appearance.safetensors`` with a ``latent``
    appearance) in two halves: the device's values are read here, on the caller's thread (the latent grid's
    through pinned memory where the device has it), and the returned function, which touches no device and so may run on
    another thread while the device works on, hashes and lays out the files' bytes by name."""
    from ..field.model_io import StudyGeometry, encode_model

    parameters = field.parameters()
    geometry = StudyGeometry.from_prepared(prepared)
    extra = {"preset": settings.preset, "cancelled": log.cancelled, "train_seconds": round(log.seconds, 2)}
    appearance = None
    if latent is not None:
        from ..appearance.latent_scene import APPEARANCE_FILE, appearance_encoder
        from ..gpu.device import ReadBack

        appearance = appearance_encoder(latent, latent.source_digest, ReadBack(gpu).read)

    def encode() -> dict[str, bytes]:
        files = {} if appearance is None else {APPEARANCE_FILE: appearance()}
        files["model.safetensors"] = encode_model(field.layout, parameters, geometry, extra)
        return files

    return encode


def write_model_files(folder: Path, encode: Callable[[], dict[str, bytes]]) -> FileSet:
    """:func:`model_encoder`'s files written into ``folder``, each flushed to the disk but not yet in place:
    :func:`write_run` puts them there with the rest of the run, or nothing (may run on another thread)."""
    files = FileSet()
    try:
        for name, data in encode().items():
            files.write_bytes(folder / name, data)
    except BaseException:
        files.discard()
        raise
    return files


def write_run(folder: Path, gpu: GpuContext, prepared: PreparedStudy, field: NeuralField, log: TrainLog,
              settings: RunSettings, source: str | None, latent=None, model_files: FileSet | None = None) -> None:
    """Save a trained field with its training log and ``run.json`` into ``folder``, the three files all or
    none (``source``: the study's file, so that ``evaluate`` can prepare the study again; None for a study
    held in memory). ``latent``: the study's pretrained appearance, saved beside the model with them.
    ``model_files``: the model files already written by :func:`write_model_files` (into ``folder``), put in
    place with the others here."""
    files = model_files or write_model_files(folder, model_encoder(gpu, prepared, field, log, settings, latent))
    try:
        train_log = json.dumps({
            "seconds": log.seconds, "render_seconds": log.render_seconds, "rays": log.rays,
            "rays_per_second": log.rays_per_second(),
            "rays_per_second_by_stage": {str(stage): log.rays_per_second(stage) for stage in sorted(log.stage_rays)},
            "rays_per_second_after_first_steps": log.rays_per_second(after_first_step=True),
            "first_step_seconds": {str(stage): seconds for stage, seconds in sorted(log.first_step_seconds.items())},
            "sdf_first_step_seconds": log.sdf_first_step_seconds,
            "cancelled": log.cancelled, "skipped_steps": log.skipped_steps,
            "mesh_seconds": log.mesh_seconds, "mesh_extractions": log.mesh_extractions, "memory": log.memory,
            "phases": log.phases, "rows": log.rows,
        }, indent=1) + "\n"
        run = json.dumps({
            "version": RUN_VERSION, "study": source, "settings": asdict(settings),
            "device": gpu.report.as_dict(), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }, indent=2) + "\n"
        files.write_text(folder / "train_log.json", train_log)
        files.write_text(folder / "run.json", run)
        files.commit()
    except BaseException:
        files.discard()
        raise


class RunNotSavedError(WriteError):
    """A trained run whose folder could not be written. The message (one line) names the folder, the cause
    and where the trained model was kept instead (``kept``; None when nowhere could take it)."""

    def __init__(self, folder: Path, cause: WriteError, kept: Path | None):
        super().__init__(folder, cause)
        self.cause_path, self.kept = cause.path, kept

    def __str__(self) -> str:
        where = (f"the trained model is kept in {self.kept} (a run folder without its reference views; move it "
                 "where you want it)" if self.kept else "the trained model could not be kept anywhere else either")
        cause = self.reason if self.cause_path == self.path else f"{self.cause_path}: {self.reason}"
        return f"{self.path}: the run could not be written ({cause}); {where}; {self.advice}"


def recovery_places() -> list[Path]:
    """Where a run that could not be written is kept instead, in the order tried."""
    return [cache_folder("recovered"), Path(tempfile.gettempdir()) / "neuralraycast-recovered"]


def keep_trained_run(folder: Path, gpu: GpuContext, prepared: PreparedStudy, field: NeuralField, log: TrainLog,
                     settings: RunSettings, source: str | None, latent=None) -> Path | None:
    """Write a trained run (without its reference views, which ``evaluate`` renders again) into the first of
    :func:`recovery_places` that takes it: a long training is not lost to a full or read-only disk. The
    folder written, or None."""
    name = f"{Path(folder).name or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"
    for place in recovery_places():
        kept, number = place / name, 1
        while kept.exists():
            number += 1
            kept = place / f"{name}-{number}"
        try:
            with atomic_folder(kept) as staging:
                write_run(staging, gpu, prepared, field, log, settings, source, latent)
        except Exception as error:  # whatever it is, the error that brought us here is the one to report
            logging.getLogger(__name__).warning("could not keep the trained run in %s: %s", place, error)
            continue
        return kept
    return None


def load_run(gpu: GpuContext, folder: str | Path, prepared: PreparedStudy) -> TrainedRun:
    """A run folder's field on ``prepared`` (the study it was trained on, prepared the same way); the model
    file's study geometry must match (ModelFileError otherwise)."""
    from ..field.model_io import load_field

    folder = Path(folder)
    settings: RunSettings = read_run(folder)["settings"]
    field = load_field(gpu, folder / "model.safetensors", prepared)
    return TrainedRun(folder, prepared, field, run_renderer(gpu, prepared, field, settings, folder), settings)


def run_renderer(gpu: GpuContext, prepared: PreparedStudy, field: NeuralField, settings: RunSettings,
                 folder: Path | None = None) -> DiffRenderer:
    """The renderer of a trained field as it was trained: with shadows from its own learned meshes if the
    run's references had shadows; with the pretrained appearance where the run ``folder`` holds one."""
    config = training_schedule(settings.preset)
    if folder is not None and (Path(folder) / "appearance.safetensors").is_file():
        from ..appearance.latent_scene import APPEARANCE_FILE, latent_renderer, load_appearance

        latent = load_appearance(gpu, Path(folder) / APPEARANCE_FILE, field)
        renderer = latent_renderer(gpu, prepared, field, latent, config.max_samples, config.render_cell_mm,
                                   config.render_shade_weight)
    else:
        renderer = field_renderer(gpu, prepared, field, config.max_samples, occupancy_cell_mm=config.render_cell_mm,
                                  shade_weight=config.render_shade_weight)  # as Trainer.use_picture_settings
    if settings.shadows:
        from ..render.style import RenderStyle

        style = RenderStyle.default(prepared.structures, prepared.channel_names)
        renderer.set_mesh_shadows(learned_mesh_shadows(gpu, prepared, field, style))
    return renderer


def read_run(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / "run.json"
    if not path.exists():
        raise FileNotFoundError(f"{folder} is not a run folder (no run.json; create one with 'neuralraycast fit')")
    try:
        run = json.loads(path.read_text())
        if run.get("version") != RUN_VERSION:
            raise ValueError(f"{path}: unsupported run version {run.get('version')!r}")
        run["settings"] = RunSettings(**run["settings"])
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path}: damaged run description ({error})") from error
    try:
        run["settings"].check(training=False)
    except ValueError as error:
        raise ValueError(f"{path}: bad value in the run description ({error})") from error
    return run


def run_metrics(gpu: GpuContext, folder: Path, prepared: PreparedStudy, field: NeuralField, views: ReferenceViews,
                settings: RunSettings, renderer=None, rendered: dict | None = None) -> dict[str, Any]:
    """The metrics of a trained field (see :func:`evaluate_run`), written to ``metrics.json``."""
    from .evaluate import geometry_metrics
    from .trainer import score_views

    renderer = renderer or run_renderer(gpu, prepared, field, settings, folder)
    metrics: dict[str, Any] = score_views(renderer, views, views.held_out, rendered)
    geometry = geometry_metrics(field, prepared)
    keys = dict.fromkeys(key for g in geometry.values() for key in g)  # dice, distances, volumes, pieces, ...
    for key in keys:  # each figure by structure (None where a structure has none: no exact surface)
        metrics[key] = {name: g.get(key) for name, g in geometry.items()}
    log_path = folder / "train_log.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    metrics["train_seconds"] = log.get("seconds")
    metrics["train_rays_per_second"] = log.get("rays_per_second")
    metrics["device"] = gpu.report.adapter
    metrics["backend"] = gpu.backend
    metrics["model_bytes"] = (folder / "model.safetensors").stat().st_size
    if (folder / "appearance.safetensors").is_file():
        metrics["appearance_bytes"] = (folder / "appearance.safetensors").stat().st_size
    metrics["preset"] = settings.preset
    metrics["image_size"] = settings.size
    metrics["study_shape"] = list(prepared.study.shape)
    write_text(folder / "metrics.json", strict_json.dumps(metrics, indent=2) + "\n")
    return metrics


def open_run(gpu: GpuContext, folder: str | Path, progress: Progress | None = None) -> TrainedRun:
    """A run folder's field on its study, prepared again from the study file recorded in ``run.json``."""
    folder = Path(folder)
    run = read_run(folder)
    if not run.get("study"):
        raise ValueError(f"{folder}: the run was trained on a study held in memory (a Slicer scene); "
                         "use it where it was trained")
    return load_run(gpu, folder, prepare_for_run(run["study"], run["settings"], progress, gpu))


def export_run(folder: str | Path, out: str | Path, precision: str = "float16", overwrite: bool = False) -> Path:
    """A copy of a run folder with its model's parameters stored in ``precision`` (float16: half the file,
    for sharing and rendering; they are turned back into float32 when loaded). Every command and the
    Slicer module read the copy as they read the run; its own scores come from evaluating it.
    ``overwrite``: a run folder at ``out`` is replaced once the copy is complete (nothing else is)."""
    from ..field.model_io import load_model, save_model

    folder, out = Path(folder), Path(out)
    read_run(folder)  # refuses what is not a run folder
    if out.exists() and (out.resolve() == folder.resolve() or any(out.iterdir())):
        if out.resolve() == folder.resolve() or not overwrite:
            raise FileExistsError(f"{out} exists and is not empty; export into a new folder, or pass --overwrite "
                                  "to replace a run folder there")
        if not (out / "run.json").is_file():
            raise FileExistsError(f"{out} is not empty and not a run folder, so --overwrite does not replace it; "
                                  "export into a new folder")
    model = load_model(folder / "model.safetensors")
    # All or nothing: a failed export (a full disk, say) leaves no half-written run folder and no staging folder.
    with atomic_folder(out, is_run_folder, "export into a new folder") as staging:
        copy_tree(folder, staging, skip=("model.safetensors", "metrics.json"))
        save_model(staging / "model.safetensors", model.layout, model.parameters, model.geometry,
                   {**model.extra, "exported_from_precision": model.precision}, precision)
    return out


def evaluate_run(gpu: GpuContext, folder: str | Path, progress: Progress | None = None) -> dict[str, Any]:
    """Held-out PSNR / SSIM against freshly rendered reference views, and per-structure Dice and surface
    distances; also written to ``metrics.json`` in the run folder."""
    run = open_run(gpu, folder, progress)
    views = reference_views_for_run(gpu, run.prepared, run.settings, progress)
    return run_metrics(gpu, run.folder, run.prepared, run.field, views, run.settings, run.renderer)
