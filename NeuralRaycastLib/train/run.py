"""The one way to train: :func:`train_study`, which the command line (``fit``), the demo and the Slicer
module all call.

    study (a file or in memory) -> prepare (downsample, brain mask, boundary maps) -> the field
        -> warm-up (compile the kernels once per machine, on a GPU) -> reference views
        -> Trainer (geometry, appearance, joint) -> run folder

The run folder is built beside its place (``files.StagedFolder``) and renamed into it only when complete: a
failed, cancelled-by-error or interrupted run leaves an earlier run there as it was and nothing half-written.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ..files import StagedFolder
from ..gpu.device import GpuContext, device_memory, device_memory_in_use, memory_budget
from ..outputs import check_output
from ..progress import Progress, ShouldStop
from ..render.camera import check_view_size
from ..render.reference_views import save_reference_views
from ..study.study import Study
from .field_ahead import FIELD_PHASE, MAPS_PHASE, FieldAhead
from .phases import PhaseClock
from .presets import RunSettings
from .pretrained import pretrained_appearance
from .run_folder import (
    RUN_FOLDER_REFUSAL,
    RunNotSavedError,
    TrainedRun,
    downsampled_for_run,
    is_run_folder,
    keep_trained_run,
    model_encoder,
    prepare_for_run,
    reference_views_for_run,
    study_within_budget,
    write_model_files,
    write_run,
)
from .trainer import TrainConfig, Trainer, score_views
from .warmup import WarmUpCancelled, ensure_warm

if TYPE_CHECKING:
    from ..appearance.latent_scene import PretrainedAppearance


class CancelledBeforeTraining(WarmUpCancelled):
    """A run stopped by its caller's ``should_stop`` before its first training step: nothing was written."""


def train_study(
    gpu: GpuContext,
    study: Study | str | Path,
    out: str | Path,
    settings: RunSettings | None = None,
    progress: Progress | None = None,
    should_stop: ShouldStop | None = None,
    *,
    warm_up: bool = True,
    worker_python: str | None = None,
    config: TrainConfig | None = None,
    overwrite: bool = False,
    appearance: PretrainedAppearance | None = None,
) -> TrainedRun:
    """Train a neural field on ``study`` and save it as a run folder ``out``; returns the trained run.

    ``study``: a study folder or manifest (recorded in the run, so ``evaluate`` can prepare it again), or a
    :class:`~NeuralRaycastLib.study.study.Study` held in memory (a Slicer scene's). ``settings``: the preset
    and its overrides (default: the device's preset). ``should_stop`` is polled between steps: a cancel keeps
    and saves the state reached (``run.log.cancelled``), or, while the kernels compile, raises
    :class:`~NeuralRaycastLib.train.warmup.WarmUpCancelled` (nothing trained).

    ``warm_up``: on a GPU that has not compiled this run's kernels yet, compile them first in worker
    processes side by side (:func:`~NeuralRaycastLib.train.warmup.ensure_warm`; ``worker_python`` is the
    interpreter they run in, default this one); compiled by the run itself they take far longer.
    ``config`` replaces the preset's training schedule whole (scripting, tests).

    The settings and ``out`` are checked before any work (:meth:`RunSettings.check`,
    :func:`~NeuralRaycastLib.outputs.check_output`): a non-empty ``out`` is refused unless it is a run of the same
    study file, or ``overwrite`` is given for an earlier run of another; whatever else a folder holds is never
    replaced. The GPU memory budget (``gpu.memory``, gpu/memory_budget.py) sizes the run: a study whose volumes it
    cannot hold is downsampled, steps take fewer patches, and a run that cannot fit at all is refused with
    GpuMemoryError before any work on the device (train/memory.py). The run folder is built beside its place and
    renamed into it only when complete, replacing an earlier run whole: a failed or interrupted run leaves that
    earlier run as it was and nothing half-written. A cancel before the first training step raises
    :class:`CancelledBeforeTraining` with nothing written. When the run folder cannot be written after training (a
    full or read-only disk), the run is kept elsewhere and
    :class:`~NeuralRaycastLib.train.run_folder.RunNotSavedError` says where.

    ``appearance``: pretrained weights (``fit --appearance pretrained``): the geometry is fitted as the preset's
    ``pretrained_fit`` says (or the given ``config``'s first stage) and the rendering stages are left out; the
    encoder then runs over the study into a latent grid, which with the pretrained decoder is the run's appearance
    (no per-study appearance training). The model files are written on a thread of their own while the renderer
    is set up.
    """
    settings = (settings or RunSettings.for_device(gpu)).check()
    check_view_size(settings.size, settings.size)  # before the study is prepared and the kernels compiled
    source = None if isinstance(study, Study) else str(Path(study).expanduser().resolve())
    folder = check_output(out, source, overwrite=overwrite, run_of=source)
    # Refused, or found unwritable, before hours of work rather than after.
    staged = StagedFolder(folder, is_run_folder, RUN_FOLDER_REFUSAL)
    budget = memory_budget(gpu)
    clock = PhaseClock(lambda: device_memory_in_use(gpu))
    writer = ThreadPoolExecutor(1, thread_name_prefix="reference-views")
    model_writer = ThreadPoolExecutor(1, thread_name_prefix="model-files")
    model_written = None
    try:
        with clock.phase("load"):
            loaded, settings = study_within_budget(study, settings, budget, progress)
            # Downsampled, or refused, before any work on the device.
            loaded = downsampled_for_run(loaded, settings, progress)
        schedule = settings.schedule(config, pretrained=appearance is not None)  # the geometry alone if pretrained
        # The field once the maps are done; with NEURALRAYCAST_FIELD_BESIDE_MAPS=1, the maps' kernels set up, then
        # the field (and the kernels the run loads next) made, while the maps are computed (train/field_ahead.py).
        ahead = FieldAhead(gpu, settings, budget, schedule, clock, appearance)
        try:
            with clock.phase(MAPS_PHASE):
                prepared = prepare_for_run(loaded, settings, progress, gpu, with_outline=ahead.start,
                                           before_maps=ahead.set_up_maps_kernels)
            with clock.phase(FIELD_PHASE):  # a run the budget cannot hold is refused here, before the field
                field = ahead.field(prepared)
        finally:
            ahead.close()
        if warm_up:
            with clock.phase("compile"):
                ensure_warm(gpu, study, prepared, settings, progress, should_stop, worker_python)
        # An allocation the device refuses outside the sized work (the volumes) is a GpuMemoryError too.
        with device_memory(f"this run ({budget.describe()})"):
            with clock.phase("reference views"):
                views = reference_views_for_run(gpu, prepared, settings, progress)
            if should_stop is not None and should_stop():
                raise CancelledBeforeTraining("cancelled before training began; nothing was written")
            # The view pictures are written while training runs: encoding them would otherwise delay its start.
            saved = writer.submit(save_reference_views, views, staged.path / "reference", arrays=False)
            with clock.phase("trainer"):
                trainer = Trainer(gpu, prepared, field, views, schedule)
            if appearance is None:
                with clock.phase("train"):
                    log = trainer.run(progress, should_stop)
            else:  # the geometry's setup and its fit apart: the route's time is theirs
                log = trainer.run(progress, should_stop, phase=clock.phase)
            latent = renderer = model_files = None
            if appearance is not None:  # a cancelled fit's geometry gets its appearance too: a run that renders
                def write_model(final) -> None:
                    """The model files written on a thread of their own while the renderer is set up."""
                    nonlocal model_written
                    encode = model_encoder(gpu, prepared, field, log, settings, final)
                    model_written = model_writer.submit(write_model_files, staged.path, encode)

                latent, renderer = pretrained_appearance(gpu, prepared, field, appearance, trainer, clock, progress,
                                                         tuning=not log.cancelled, finished=write_model)
                log.memory["band_rays"] = renderer.band_rays()
                with clock.phase("model written"):
                    try:
                        model_files = model_written.result()
                    except OSError:  # written again with the rest, where the failure is reported as any save's
                        model_files = None
                if not log.cancelled:
                    step = schedule.geometry.steps + int(log.last("fine_tune_steps") or 0)
                    log.rows.append({"step": step, "stage": 2, "seconds": log.seconds,
                                     **score_views(renderer, views, views.held_out)})
            else:
                with clock.phase("picture settings"):
                    trainer.use_picture_settings()
    except BaseException:
        writer.shutdown(cancel_futures=True)
        model_writer.shutdown()  # its files are in the staging folder, discarded with it
        staged.discard()
        raise
    model_writer.shutdown()
    log.phases = clock.as_list()  # train_log.json's record; the save's own time is only in the returned run's
    try:
        with clock.phase("reference views written"):  # the pictures of the held-out score, not the model's
            saved.result()  # a failed write surfaces here, before anything says the run is done
        with clock.phase("save"):
            write_run(staged.path, gpu, prepared, field, log, settings, source, latent, model_files)
            staged.commit()
    except OSError as error:
        staged.discard()
        kept = keep_trained_run(folder, gpu, prepared, field, log, settings, source, latent)
        raise RunNotSavedError(folder, staged.error(error), kept) from error
    except BaseException:
        staged.discard()
        raise
    finally:
        writer.shutdown()
    return TrainedRun(folder, prepared, field, renderer or trainer.renderer, settings, views, log, clock)
