"""Run folders of the Gaussian branch: ``fit --representation gaussians``, and ``evaluate`` and ``render`` on them.

A Gaussian run folder holds what a field's does, with ``gaussians.safetensors`` in place of
``model.safetensors`` and ``"representation": "gaussians"`` in ``run.json``: the same presets, reference views,
held-out split and progress, built beside its place and renamed into it only when complete.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .. import strict_json
from ..field.model_io import StudyGeometry
from ..files import StagedFolder, atomic_files, write_text
from ..gpu.device import GpuContext, device_memory, memory_budget
from ..outputs import check_output
from ..progress import Progress, ShouldStop
from ..render.camera import Camera, check_view_size
from ..render.image import RenderedImage
from ..render.reference_views import ReferenceViews, save_reference_views
from ..study.preprocess import PreparedStudy
from ..study.study import Study
from ..train.presets import RunSettings
from ..train.run_folder import (
    RUN_FOLDER_REFUSAL,
    RUN_VERSION,
    is_run_folder,
    prepare_for_run,
    read_run,
    reference_views_for_run,
)
from .geometry import (
    StructureTrainConfig,
    gaussian_geometry_metrics,
    gaussian_meshes,
    occupancy_distances,
    train_structure_weights,
)
from .look import study_channels
from .model_io import GaussianModel, encode_gaussians, load_gaussians
from .scene import GaussianScene
from .train import GaussianTrainConfig, GaussianTrainLog, score_views, train_gaussians

MODEL_FILE = "gaussians.safetensors"
REPRESENTATION = "gaussians"

#: The Gaussian schedule of each preset: a CPU's is small enough for a test; a GPU's trains the sample. The
#: standard one takes few steps of large batches (512 patches, 131,072 rays): in the same time, more Gaussians,
#: densifying more often, a higher learning rate or smaller batches all gave lower held-out scores. The two short
#: schedules prune but do not grow (``densify_until`` 0): a split or a clone left the even layer of Gaussians
#: less even than the steps after it could mend. The standard one also ends at 30 s of training
#: (GaussianTrainConfig.seconds), its learning rates and densification then following the time, on a GPU slower
#: than the one its steps were sized on (docs/gaussians.md).
SCHEDULES = {
    "quick": GaussianTrainConfig(steps=150, patches=8, initial=3000, eval_every=50, densify_every=30,
                                 densify_until=0.0),
    "standard": GaussianTrainConfig(steps=400, patches=512, initial=90_000, max_gaussians=1_000_000,
                                    eval_every=40, densify_every=100, densify_until=0.0, structure_steps=300,
                                    seconds=30.0),
    "high": GaussianTrainConfig(steps=6000, patches=64, initial=100_000, max_gaussians=2_000_000,
                                eval_every=500, densify_every=100, structure_steps=600),
}


def gaussian_schedule(settings: RunSettings) -> GaussianTrainConfig:
    """The preset's schedule, with the run's seed and ``iterations`` (steps) where given: then those steps, with
    no time budget to cut them short."""
    config = replace(SCHEDULES[settings.preset], seed=settings.seed)
    return replace(config, steps=settings.iterations, seconds=None) if settings.iterations else config


def is_gaussian_run(folder: str | Path) -> bool:
    return (Path(folder) / MODEL_FILE).is_file()


@dataclass
class GaussianRun:
    folder: Path
    prepared: PreparedStudy
    scene: GaussianScene
    settings: RunSettings
    log: GaussianTrainLog | None = None
    #: (N, 2K) structure weights: logits, then slopes (gaussians/geometry.py).
    structures: np.ndarray | None = None

    def render(self, camera: Camera) -> RenderedImage:
        """The Gaussians' G-buffer: premultiplied RGBA, expected depth and the density's normals."""
        return self.scene.render_image(camera)

    def render_picture(self, camera: Camera) -> np.ndarray:
        """The live view's picture, as a field run's: straight-alpha bytes (H, W, 4), the rows from the bottom."""
        return self.scene.render_picture(camera)

    @property
    def gpu(self) -> GpuContext:
        """The device the run renders on, as a field run's."""
        return self.scene.gpu

    def distances(self) -> np.ndarray:
        """(K, I, J, K) signed distances (mm) of the structures' insides from the Gaussians' structure weights."""
        return occupancy_distances(self.scene, self.structures, self.prepared)

    def meshes(self, smoothing_iterations: int = 0, decimation: float = 0.0) -> list:
        """One mesh per structure (mesh/mesh.py's Mesh), as a field run's ``meshes``."""
        return gaussian_meshes(self.distances(), self.prepared, smoothing_iterations, decimation)


def fit_gaussians(gpu: GpuContext, study: Study | str | Path, out: str | Path, settings: RunSettings | None = None,
                  progress: Progress | None = None, should_stop: ShouldStop | None = None, *,
                  config: GaussianTrainConfig | None = None, overwrite: bool = False) -> GaussianRun:
    """Train Gaussians on ``study`` into the run folder ``out`` (checked before any work, as ``train_study``
    checks it); ``config`` replaces the preset's schedule whole. A cancel keeps and saves the state reached."""
    settings = (settings or RunSettings.for_device(gpu)).check()
    check_view_size(settings.size, settings.size)
    source = None if isinstance(study, Study) else str(Path(study).expanduser().resolve())
    folder = check_output(out, source, overwrite=overwrite, run_of=source)
    staged = StagedFolder(folder, is_run_folder, RUN_FOLDER_REFUSAL)
    try:
        prepared = prepare_for_run(study, settings, progress)
        with device_memory(f"this run ({memory_budget(gpu).describe()})"):
            views = reference_views_for_run(gpu, prepared, settings, progress)
            config = config or gaussian_schedule(settings)
            scene, log = train_gaussians(gpu, prepared, views, config, progress, should_stop)
            structures, structure_losses = fit_structure_weights(scene, prepared, config, log, should_stop)
        save_reference_views(views, staged.path / "reference", arrays=False)
        write_gaussian_run(staged.path, gpu, prepared, scene, log, settings, source, structures, structure_losses)
        staged.commit()
    except BaseException:
        staged.discard()
        raise
    return GaussianRun(folder, prepared, scene, settings, log, structures)


def fit_structure_weights(scene: GaussianScene, prepared: PreparedStudy, config: GaussianTrainConfig,
                          log: GaussianTrainLog, should_stop: ShouldStop | None = None) \
        -> tuple[np.ndarray, list[tuple[int, float]]]:
    """The structure weights once the picture steps are done (gaussians/geometry.py), from those trained with the
    pictures or else the boundary maps, by ``config``'s steps (none after a cancel), and their losses."""
    return train_structure_weights(scene, prepared, StructureTrainConfig(
        steps=0 if log.cancelled else config.structure_steps, seed=config.seed), should_stop, initial=log.structures)


def write_gaussian_run(folder: Path, gpu: GpuContext, prepared: PreparedStudy, scene: GaussianScene,
                       log: GaussianTrainLog, settings: RunSettings, source: str | None, structures: np.ndarray,
                       structure_losses: list[tuple[int, float]]) -> None:
    """The model with its structure weights, its training log and ``run.json``, all or none."""
    extra = {"preset": settings.preset, "cancelled": log.cancelled, "train_seconds": round(log.seconds, 2)}
    model = encode_gaussians(GaussianModel(scene.gaussians(), scene.grid, scene.density_scale, scene.march,
                                           StudyGeometry.from_prepared(prepared), extra, structures,
                                           scene.geometry_thickness, scene.highlights))
    heldout = log.scores[-1][1] if log.scores else None
    train_log = json.dumps({"representation": REPRESENTATION, "seconds": log.seconds,
                            "eval_seconds": log.eval_seconds,
                            "first_step_seconds": log.first_step_seconds, "steps": log.steps,
                            "cancelled": log.cancelled, "gaussians": scene.count, "cap": log.cap,
                            "counts": log.counts, "scores": log.scores, "heldout_psnr": heldout,
                            "losses": log.losses[-50:],
                            "structure_losses": structure_losses[::10] + structure_losses[-1:],
                            "joint_structure_losses": log.structure_losses}, indent=1) + "\n"
    run = json.dumps({"version": RUN_VERSION, "representation": REPRESENTATION, "study": source,
                      "settings": asdict(settings), "device": gpu.report.as_dict(),
                      "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2) + "\n"
    with atomic_files() as files:
        files.write_bytes(folder / MODEL_FILE, model)
        files.write_text(folder / "train_log.json", train_log)
        files.write_text(folder / "run.json", run)


def open_gaussian_run(gpu: GpuContext, folder: str | Path, progress: Progress | None = None) -> GaussianRun:
    """A Gaussian run folder's scene on its study, prepared again from the study file in ``run.json``; the model
    file's study geometry must match (ModelFileError otherwise)."""
    folder = Path(folder)
    run = read_run(folder)
    if not run.get("study"):
        raise ValueError(f"{folder}: the run was trained on a study held in memory (a Slicer scene); "
                         "use it where it was trained")
    model = load_gaussians(folder / MODEL_FILE)  # a damaged or old file is refused before the study is prepared
    prepared = prepare_for_run(run["study"], run["settings"], progress)
    return _run_on(gpu, folder, run["settings"], model, prepared)


def evaluate_gaussian_run(gpu: GpuContext, folder: str | Path, progress: Progress | None = None) -> dict[str, Any]:
    """Held-out PSNR / SSIM against freshly rendered reference views, the geometry per structure as a field
    run's (Dice, surface distances, volumes, pieces: each figure by structure name), with the training time,
    the number of Gaussians and the model's bytes; also written to ``metrics.json``. A model file without
    structure weights (version 1) is refused before any picture is rendered."""
    run = open_gaussian_run(gpu, folder, progress)
    distances = run.distances()
    views: ReferenceViews = reference_views_for_run(gpu, run.prepared, run.settings, progress)
    metrics: dict[str, Any] = {"representation": REPRESENTATION,
                               **score_views(run.scene, views, views.held_out)}
    geometry = gaussian_geometry_metrics(distances, run.prepared)
    for key in dict.fromkeys(key for figures in geometry.values() for key in figures):
        metrics[key] = {name: figures.get(key) for name, figures in geometry.items()}
    log_path = run.folder / "train_log.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    metrics.update(train_seconds=log.get("seconds"), gaussians=run.scene.count,
                   model_bytes=(run.folder / MODEL_FILE).stat().st_size, device=gpu.report.adapter,
                   backend=gpu.backend, preset=run.settings.preset, image_size=run.settings.size,
                   study_shape=list(run.prepared.study.shape))
    write_text(run.folder / "metrics.json", strict_json.dumps(metrics, indent=2) + "\n")
    return metrics


def load_gaussian_run(gpu: GpuContext, folder: str | Path, prepared: PreparedStudy) -> GaussianRun:
    """A Gaussian run folder's scene on a study the caller prepared (as ``load_run`` for a field: a Slicer
    scene's study, whose file the run recorded may be gone); the model file's study geometry must match
    (ModelFileError otherwise)."""
    folder = Path(folder)
    return _run_on(gpu, folder, read_run(folder)["settings"], load_gaussians(folder / MODEL_FILE), prepared)


def _run_on(gpu: GpuContext, folder: Path, settings: RunSettings, model: GaussianModel,
            prepared: PreparedStudy) -> GaussianRun:
    """The run folder's Gaussians on ``prepared``, refused (ModelFileError) where they were made for another
    study."""
    model.geometry.check_matches(StudyGeometry.from_prepared(prepared), folder / MODEL_FILE)
    scene = GaussianScene(gpu, model.gaussians, model.grid, model.density_scale, model.march,
                          model.geometry_thickness, study_channels(gpu, prepared, model.gaussians), model.highlights)
    return GaussianRun(folder, prepared, scene, settings, structures=model.structures)
