"""Compile ahead: every kernel a run uses, into the persistent shader cache, so later runs start at once.

A run's kernels fall into parts: the SDF fit (stage 1); the rendering stages' forward passes with the
appearance backward (stage 2) and evaluation renders; the joint backward's two passes (stage 3: the scene's
backward through the distances, and through the normals and appearance), each a part of its own, the
slowest kernels to compile (split in two, that backward compiles beside the other parts and the warm-up
ends sooner than with it as one part; BENCHMARKS.md); a joint step, which then only loads them; and the
pretrained appearance's kernels (``fit --appearance pretrained``: encoder, fine-tune, its pictures). One step of
each part is run on tiny views with a fresh field: what is compiled is exactly what training calls. The joint
backward's kernels are compiled by a launch over an empty batch (every entry past the end of its list: nothing
is computed), so they need no forward pass first. Slang and the GPU compiler work on one kernel at a time in
a process, so on a machine with cores to spare the first four parts compile in parallel processes
(``jobs``); the shader cache is a database that several processes may fill at once. The joint step's
process starts once they have ended (:data:`AFTER`) and finds their kernels cached. On a GPU each part gets
a process of its own even one at a time: the joint backward compiles far more slowly in a process that has
just compiled the other parts than in a fresh one (BENCHMARKS.md).

The field's kernels hold a capacity of structures (4 or 8) and appearance inputs rather than a study's own
counts (field.py's FieldLayout), so a warm-up on one study serves every study whose counts fit the same
capacity; asked to (``structure_slots``), it also compiles the other capacity on the same study, so that a
later study with any number of structures compiles nothing.

``python -m NeuralRaycastLib.train.warmup STUDY PART [--preset P] [--device D] [--structure-slots N]`` is the
worker a parallel warm-up starts for each part.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import IO

import numpy as np

from .. import __version__
from ..field.field import COOPERATIVE_ENV, COOPVEC_ENV, FieldLayout, NeuralField
from ..field.sdf_fit import SdfFitter
from ..files import write_text
from ..gpu.device import GpuContext, open_device
from ..paths import shader_sources_digest
from ..progress import Cancelled, Progress, ShouldStop
from ..render.reference_views import ReferenceViews, render_reference_views
from ..render.sample_buffers import RayBatch
from ..render.scene import WAVE, WorkLists
from ..study.preprocess import PreparedStudy
from ..study.study import Study, downsample_study, write_study
from .presets import RunSettings, training_schedule
from .run_folder import prepare_for_run
from .trainer import Trainer, score_views


class WarmUpCancelled(Cancelled):
    """A warm-up stopped by its caller's ``should_stop`` (its worker processes killed); nothing was trained."""


PARTS = {
    "fit": "SDF fit (stage 1)",
    "appearance": "render forward, appearance backward (stage 2), evaluation renders",
    "backward-distances": "joint backward: distances (stage 3)",
    "backward-surface": "joint backward: normals and appearance (stage 3)",
    "joint": "joint step (stage 3), its kernels compiled by the other parts",
    "pretrained": "pretrained appearance: encoder, fine-tune step, pictures (fit --appearance pretrained)",
}
#: A part started in its own process only once these parts have ended: the joint step runs the kernels of all
#: the others, which it then finds in the shader cache instead of compiling them a second time.
AFTER = {"joint": ("fit", "appearance", "backward-distances", "backward-surface")}
#: The joint backward's two passes, each compiled by a part of its own (the entries it lists: shaded, touched).
BACKWARD_PASSES = {"backward-distances": (0, WAVE), "backward-surface": (WAVE, 0)}


def tiny_views(gpu: GpuContext, prepared: PreparedStudy) -> ReferenceViews:
    """Two 16² reference views (one held out): enough to run every training kernel once."""
    return render_reference_views(gpu, prepared, 2, 16, 16, held_out_every=2)


def run_layout(gpu: GpuContext, prepared: PreparedStudy, settings: RunSettings,
               structure_slots: int | None = None) -> FieldLayout:
    """The layout a run of ``settings`` trains on ``prepared``, on kernels of ``structure_slots`` structures
    where given (None: the run's own capacity)."""
    layout = settings.field_layout(gpu, prepared)
    return layout if structure_slots is None else layout.with_structure_capacity(structure_slots)


def warm_up_part(gpu: GpuContext, prepared: PreparedStudy, views: ReferenceViews, settings: RunSettings,
                 part: str, structure_slots: int | None = None) -> None:
    """Run one step of ``part`` (a key of :data:`PARTS`) as training would, on a fresh field (on kernels of
    ``structure_slots`` structures where given)."""
    if part not in PARTS:
        raise ValueError(f"unknown warm-up part '{part}' ({', '.join(PARTS)})")
    field = NeuralField(gpu, run_layout(gpu, prepared, settings, structure_slots), seed=settings.seed)
    config = replace(training_schedule(settings.preset, settings.seed).with_total_steps(3), patches=1,
                     shadows=settings.shadows)
    trainer = Trainer(gpu, prepared, field, views, config)
    if part == "fit":
        warm_up_maps(gpu)
        SdfFitter(gpu, prepared, field, config.geometry).run()
        trainer.refresh_occupancy()  # the learned distances on the occupancy grid
    elif part in BACKWARD_PASSES:
        shaded, touched = BACKWARD_PASSES[part]
        compile_scene_backward(trainer, WorkLists(shaded=shaded, touched=touched))
    elif part == "pretrained":
        if not settings.shadows:  # the pretrained route does not take shadows (refused before a run)
            warm_up_pretrained(trainer)
    else:
        adam, sdf = trainer.render_optimisers(2)
        if part == "appearance":
            if settings.shadows:
                trainer.refresh_meshes()
            trainer.render_step(0, False, adam, sdf)
            trainer.evaluate_views()
        else:
            trainer.render_step(1, True, adam, sdf)
    gpu.device.wait()


def warm_up_maps(gpu: GpuContext) -> None:
    """The boundary maps' device kernels (study/device_distance.py), where a run's preparation takes its maps'
    distances on this device: a tiny transform and a one-triangle mesh."""
    from ..study.device_distance import distance_transform, maps_device, mesh_distances

    if maps_device(gpu) is None:
        return
    inside = np.zeros((4, 4, 4), bool)
    inside[1:3, 1:3, 1:3] = True
    distance_transform(gpu, inside, np.ones(3))
    mesh_distances(gpu, np.eye(3), np.array([[0, 1, 2]]), np.zeros((1, 3)), np.zeros((1, 1), np.int64))


def warm_up_pretrained(trainer: Trainer) -> None:
    """The kernels ``fit --appearance pretrained`` adds to the SDF fit's, at the shipped weights' sizes: the
    encoder into the latent grid, a fine-tune step (its backward pass compiled over an empty batch, as the joint
    backward's, so a fresh field with no surface yet still builds it), the finished run's renderer and its
    held-out score, each called as the run calls it."""
    from ..appearance.latent_scene import PretrainedAppearance
    from ..appearance.pretrain import SHIPPED_WEIGHTS
    from .phases import PhaseClock
    from .pretrained import pretrained_appearance

    appearance = PretrainedAppearance.read(SHIPPED_WEIGHTS, fine_tune_steps=1)
    _latent, renderer = pretrained_appearance(trainer.gpu, trainer.prepared, trainer.field, appearance, trainer,
                                              PhaseClock(), None)
    compile_scene_backward(trainer, WorkLists(shaded=WAVE, touched=0))  # the fine-tune's renderer: the latent scene
    score_views(renderer, trainer.views, trainer.views.held_out)


def compile_scene_backward(trainer: Trainer, lists: WorkLists) -> None:
    """Build the kernels of the scene's backward passes as a joint step calls them, over a new batch whose
    work lists are empty on the device: every launched entry lies past the end of its list and does nothing
    (a wave of them leaves at once), so no forward pass has to fill the batch first. ``lists`` says which
    passes to launch: a pass whose list is given as empty is not launched, so not compiled."""
    renderer = trainer.renderer
    batch = RayBatch(trainer.gpu, WAVE, renderer.max_samples, renderer.scene.structures)
    batch.keep_gradients(WAVE)
    renderer.scene.backward(lists, batch.struct)


def default_jobs(gpu: GpuContext) -> int:
    """Parallel processes for a warm-up: on a GPU machine up to four, the SDF fit, the forward passes and the
    joint backward's two passes side by side, where it has two cores for each (the joint step then follows:
    see :data:`AFTER`); one on a software device (its compiler already uses every core, and each process
    would hold its own device)."""
    if gpu.report.software:
        return 1
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def warm_up(gpu: GpuContext, study_path: str | Path, settings: RunSettings, progress: Progress | None = None,
            jobs: int = 1, should_stop: ShouldStop | None = None, python: str | None = None,
            structure_slots: tuple[int, ...] = ()) -> dict[str, float]:
    """Compile every kernel a run of ``settings`` on this study file uses (reference renderer, SDF fit, both
    backward passes of the renderer, Adam); ``jobs`` > 1 compiles the parts in that many processes at
    once (each opens the backend ``gpu`` runs on). The kernels hold a capacity of structures and inputs, not
    the study's counts: a study whose counts fit the same capacity runs on them. ``structure_slots``: also the
    kernels of these structure capacities (those that hold the study's structures; STRUCTURE_SLOTS: all), so
    that a study with any number of structures compiles nothing. On a GPU every part runs in a
    worker process of its own, even one at a time (a part compiled after the others in the same process is
    much slower: see the module docstring); on a software device with ``jobs`` = 1, in this process. Leaves
    a stamp (:func:`warm_up_stamp`) per capacity once done. Returns seconds per phase (the parts' own seconds,
    and with worker processes the wall time they took together; another capacity's named with its structures).
    With worker processes, ``should_stop`` is polled while they run (True: they are killed and
    :class:`WarmUpCancelled` raised) and ``python`` is the interpreter they run in (default: this one;
    Slicer's is ``PythonSlicer``)."""
    report = progress or (lambda message, fraction: None)
    seconds: dict[str, float] = {}
    clock = time.perf_counter()
    prepared = prepare_for_run(study_path, settings)  # also fills the study cache the workers read
    seconds["prepare the study"] = time.perf_counter() - clock
    clock = time.perf_counter()
    report("reference renderer", 0.1)
    views = tiny_views(gpu, prepared)
    seconds["reference renderer"] = time.perf_counter() - clock
    capacities: list[int | None] = [None]  # None: the study's own
    if structure_slots:
        own = settings.field_layout(gpu, prepared).capacity[0]
        capacities += sorted({s for s in structure_slots if s != own and s >= len(prepared.structures)})
    for slots in capacities:
        named, other = ("", ()) if slots is None else (f"{slots} structures: ", (slots,))
        part_seconds: dict[str, float] = {}
        if jobs <= 1 and gpu.report.software:
            for index, (part, title) in enumerate(PARTS.items()):
                report(named + title, 0.2 + 0.8 * index / len(PARTS))
                clock = time.perf_counter()
                warm_up_part(gpu, prepared, views, settings, part, *other)
                part_seconds[title] = time.perf_counter() - clock
        else:
            part_seconds = _parts_in_processes(study_path, settings, gpu.backend, jobs, report, should_stop, python,
                                               *other)
        seconds.update({named + title: value for title, value in part_seconds.items()})
        stamp = warm_up_stamp(gpu, prepared, settings, *other)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        write_text(stamp, json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": part_seconds},
                                     indent=1))
    report("done", 1.0)
    return seconds


def kernels_key(gpu: GpuContext, prepared: PreparedStudy, settings: RunSettings,
                structure_slots: int | None = None) -> str:
    """What the kernels of a run depend on, as a hash: the shader sources, the sizes of the field's kernels for
    this study (its network sizes at the kernels' capacity, not the study's counts, box or voxels), the preset
    and shadows, the device and the versions. A warm-up leaves a stamp by this key.
    ``structure_slots``: the key of the kernels of that capacity instead of the run's own."""
    layout = run_layout(gpu, prepared, settings, structure_slots)
    described = {
        "version": __version__, "slangpy": gpu.report.slangpy_version, "backend": gpu.backend,
        "adapter": gpu.report.adapter, "defines": layout.kernels.defines(), "preset": settings.preset,
        "shadows": bool(settings.shadows), "cooperative": os.environ.get(COOPERATIVE_ENV, ""),
        "coop_vectors": os.environ.get(COOPVEC_ENV, ""),
        "parts": list(PARTS),  # a warm-up from before a part was added did not compile that part's kernels
    }
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode())
    digest.update(shader_sources_digest().encode())
    return digest.hexdigest()[:32]


def warm_up_stamp(gpu: GpuContext, prepared: PreparedStudy, settings: RunSettings,
                  structure_slots: int | None = None) -> Path:
    """Where a finished warm-up of these kernels is noted: beside the shader cache it filled, so clearing
    that cache (``neuralraycast cache --clear shaders``) clears the stamps too."""
    key = kernels_key(gpu, prepared, settings, structure_slots)
    return Path(gpu.report.shader_cache) / "warm-ups" / f"{key}.json"


def ensure_warm(gpu: GpuContext, study: Study | str | Path, prepared: PreparedStudy, settings: RunSettings,
                progress: Progress | None = None, should_stop: ShouldStop | None = None, python: str | None = None
                ) -> dict[str, float] | None:
    """Before a run on a GPU: unless a warm-up has compiled this run's kernels on the machine already (its
    stamp), run one, its parts in worker processes side by side; compiled by the run itself, one kernel after
    another in one process, they take far longer. A software device compiles in the run's own process either
    way: nothing to do there.

    ``study``: the run's study file, which the workers read, or a study held in memory (a Slicer scene's),
    for which they read a stand-in written to a temporary folder (:func:`_write_stand_in`). ``prepared``: the
    study as the run prepared it (it gives the kernels' sizes). A failed warm-up is reported and the run goes
    on, compiling what it needs itself. ``should_stop`` and ``python``: see :func:`warm_up` (a cancel raises
    :class:`WarmUpCancelled`). Returns the warm-up's seconds, or None where none ran."""
    if not needs_warm_up(gpu, prepared, settings):
        return None
    if not isinstance(study, Study):
        return _warm_up_before_run(gpu, study, settings, progress, should_stop, python)
    with tempfile.TemporaryDirectory(prefix="neuralraycast-warm-up-") as folder:
        try:
            stand_in = _write_stand_in(gpu, study, prepared, settings, Path(folder) / "stand-in")
            path, settings = stand_in or (write_study(study, Path(folder) / "study"), settings)
        except OSError as error:  # no room for it, say: as a failed warm-up, the run compiles itself
            print(f"warning: the warm-up could not write the study ({error}); the run compiles its kernels itself",
                  file=sys.stderr)
            return None
        return _warm_up_before_run(gpu, path, settings, progress, should_stop, python)


def needs_warm_up(gpu: GpuContext, prepared: PreparedStudy, settings: RunSettings) -> bool:
    """Whether a run of ``settings`` on this study should warm up first: on a GPU with no stamp of a warm-up
    of these kernels (a software device compiles in the run's own process either way)."""
    return not gpu.report.software and not warm_up_stamp(gpu, prepared, settings).exists()


def _warm_up_before_run(gpu: GpuContext, study_path: str | Path, settings: RunSettings, progress: Progress | None,
                        should_stop: ShouldStop | None, python: str | None) -> dict[str, float] | None:
    """:func:`warm_up` in processes side by side, its progress saying why the run waits; a failure is
    reported and the run goes on (None)."""
    report = progress or (lambda message, fraction: None)
    try:
        return warm_up(gpu, study_path, settings,
                       lambda message, fraction: report(f"compiling kernels (once per machine): {message}", fraction),
                       jobs=default_jobs(gpu), should_stop=should_stop, python=python)
    except RuntimeError as error:
        print(f"warning: the warm-up failed ({error}); the run compiles its kernels itself", file=sys.stderr)
        return None


#: Seconds between progress reports while the workers compile (each part takes many seconds).
REPORT_EVERY_S = 1.0

#: The largest side, in voxels, of the stand-in that a study held in memory sends to the warm-up's workers.
STAND_IN_VOXELS = 64


def _write_stand_in(gpu: GpuContext, study: Study, prepared: PreparedStudy, settings: RunSettings,
                    folder: Path) -> tuple[Path, RunSettings] | None:
    """The study downsampled to :data:`STAND_IN_VOXELS`, written to ``folder`` where it has the study's kernels,
    and the settings the warm-up runs it with (the field sized for the study's voxels); None where it has not
    those kernels, or lost a structure."""
    stand_in_settings = replace(settings, field_voxel_mm=float(prepared.spacing.min()))
    try:
        stand_in = downsample_study(study, STAND_IN_VOXELS)
        stand_in_key = kernels_key(gpu, prepare_for_run(stand_in, stand_in_settings), stand_in_settings)
    except ValueError:  # a structure too small to survive the downsampling (StudyError)
        return None
    if stand_in_key != kernels_key(gpu, prepared, settings):
        return None
    return write_study(stand_in, folder), stand_in_settings


def _parts_in_processes(study_path: str | Path, settings: RunSettings, device: str | None, jobs: int,
                        report: Progress, should_stop: ShouldStop | None = None,
                        python: str | None = None, structure_slots: int | None = None) -> dict[str, float]:
    """Each part in its own worker process, at most ``jobs`` at once; seconds of each and of them all."""
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    waiting = list(PARTS)
    running: dict[str, tuple[subprocess.Popen, float, IO[str]]] = {}
    failures: dict[str, str] = {}  # part: the last line its worker wrote (its exception)
    # The workers import this package from where this process found it (an interpreter such as Slicer's
    # PythonSlicer does not have a scripted module's folder on its path).
    package_parent = str(Path(__file__).resolve().parent.parent)
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, environment.get("PYTHONPATH")) if p)

    def stop_workers() -> None:
        for process, _, _ in running.values():
            process.kill()
            process.wait()

    reported = start
    with ExitStack() as files:
        files.callback(stop_workers)  # cancelled or failed: none is left running
        while waiting or running:
            if should_stop is not None and should_stop():
                raise WarmUpCancelled("cancelled while compiling the kernels; nothing was trained")
            if running and (now := time.perf_counter()) - reported >= REPORT_EVERY_S:  # still alive
                report(f"{len(seconds)} of {len(PARTS)} parts compiled, {len(running)} compiling "
                       f"({now - start:.0f} s)", 0.2 + 0.8 * len(seconds) / len(PARTS))
                reported = now
            while len(running) < jobs and (ready := [p for p in waiting
                                                      if not any(d in waiting or d in running
                                                                 for d in AFTER.get(p, ()))]):
                part = ready[0]
                waiting.remove(part)
                command = [python or sys.executable, "-m", __name__, str(study_path), part, "--preset", settings.preset]
                command += ["--device", device] if device else []
                command += ["--field-voxel-mm", repr(settings.field_voxel_mm)] if settings.field_voxel_mm else []
                command += ["--shadows"] if settings.shadows else []
                command += ["--structure-slots", str(structure_slots)] if structure_slots else []
                errors = files.enter_context(tempfile.TemporaryFile("w+"))  # a file: a chatty worker never blocks
                running[part] = (subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, env=environment),
                                 time.perf_counter(), errors)
            time.sleep(0.05)
            for part, (process, began, errors) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[part]
                seconds[PARTS[part]] = time.perf_counter() - began
                if process.returncode != 0:
                    errors.seek(0)
                    lines = errors.read().strip().splitlines() or [f"exit status {process.returncode}"]
                    failures[part] = lines[-1]
                report(f"{PARTS[part]}: compiled", 0.2 + 0.8 * len(seconds) / len(PARTS))
    if failures:
        raise RuntimeError("warm-up failed in " + "; ".join(f"{part}: {failures[part]}" for part in PARTS
                                                            if part in failures))
    seconds[f"all parts ({jobs} processes)"] = time.perf_counter() - start
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one part of a parallel warm-up (see the module docstring)")
    parser.add_argument("study")
    parser.add_argument("part", choices=list(PARTS))
    parser.add_argument("--preset", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--shadows", action="store_true")
    parser.add_argument("--field-voxel-mm", type=float, default=None,
                        help="size the field for voxels of this size (a stand-in's study's) instead of the study's")
    parser.add_argument("--structure-slots", type=int, default=None,
                        help="compile the kernels that hold this many structures instead of the study's own")
    args = parser.parse_args(argv)
    gpu = open_device(args.device)
    settings = RunSettings.for_device(gpu, args.preset, shadows=args.shadows or None,
                                      field_voxel_mm=args.field_voxel_mm)
    prepared = prepare_for_run(args.study, settings)
    warm_up_part(gpu, prepared, tiny_views(gpu, prepared), settings, args.part, args.structure_slots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
