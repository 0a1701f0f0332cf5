"""``neuralraycast bench``: speed measurements on the current device, as Markdown for BENCHMARKS.md.

Targets are checked here, never in timed tests. Each suite returns rows of (metric, value, unit, notes).
"""

from __future__ import annotations

import datetime
import importlib.util
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ..gpu.device import GpuContext, device_memory_in_use, memory_budget
from ..gpu.memory_budget import MemoryBudget
from .branches import bench_branches
from .kernel_clock import kernel_clock
from .report import BenchReport, BenchRow, frame_notes, timed, timed_each
from .torch_peer import band_sample, bench_torch_peer
from .workstation import bench_workstation


def bench_reference(gpu: GpuContext, prepared, quick: bool, progress) -> list[BenchRow]:
    """Reference images per second (render + read-back) at 512² and 1024², without and with shadows."""
    from ..render.camera import orbit_cameras
    from ..render.reference_render import ReferenceRenderer, hybrid_shadows

    renderer = ReferenceRenderer(gpu, prepared)
    start = time.perf_counter()
    mesh = hybrid_shadows(gpu, prepared, renderer.style)
    build = time.perf_counter() - start
    rows = [BenchRow("reference", "meshes + BVH for hybrid shadows", build, "s",
                     f"{mesh.bvh.triangle_count} triangles, marching cubes on the CPU")]
    modes = {"no shadows": {"shadows": False}, "volumetric shadows": {"shadows": True},
             "mesh shadows": {"mesh_shadows": mesh}}
    for size in (512, 1024):
        camera = orbit_cameras(prepared.bounds, 3, size, size)[1]
        for label, options in modes.items():
            progress(f"reference {size}² {label}", 0.0)
            first = time.perf_counter()
            renderer.render(camera, **options)  # compiles on first use
            first = time.perf_counter() - first
            seconds, repeats = timed(lambda c=camera, o=options: renderer.render(c, **o),
                                     0.5 if quick else 3.0, 3 if quick else 50)
            rows.append(BenchRow("reference", f"images/s {size}² {label}", 1.0 / seconds, "1/s",
                                 f"{seconds * 1e3:.1f} ms each, {repeats} runs; first {first:.2f} s"))
    return rows


def bench_sdf_fit(gpu: GpuContext, prepared, quick: bool, progress) -> list[BenchRow]:
    """Stage-1 SDF fitting: points/s (forward + backward + Adam) and the time until the mean |s − B| within
    5 mm of each surface is at most 0.5 mm (issue target on an H100: ≥ 200 M points/s, ≤ 10 s)."""
    from ..field.field import FieldLayout, NeuralField
    from ..field.sdf_fit import FitConfig, SdfFitter, band_errors

    layout = FieldLayout.for_study(prepared)
    start = time.perf_counter()
    field = NeuralField(gpu, layout, seed=0)
    load = time.perf_counter() - start
    batch = 1 << (14 if quick else 18)
    budget = 20.0 if quick else 60.0
    fit_config = FitConfig(steps=100_000, batch=batch, monitor_every=1 << 30)
    fitter = SdfFitter(gpu, prepared, field, fit_config)

    points, reference = band_sample(prepared)  # fixed evaluation points: voxel centres within 5 mm of a surface

    # The first step compiles the fit kernels (seconds on CUDA, a minute or more on lavapipe; once per machine with a
    # persistent cache; `neuralraycast warmup` does it ahead): timed apart, then the fit starts afresh.
    start = time.perf_counter()
    fitter.step()
    gpu.device.wait()
    first = time.perf_counter() - start
    field.set_parameters(layout.initial_parameters(seed=0))
    field.zero_gradients()
    fitter = SdfFitter(gpu, prepared, field, fit_config)
    elapsed, steps, error = 0.0, 0, float("inf")
    while elapsed < budget:
        chunk = time.perf_counter()
        for _ in range(25):
            fitter.step()
        gpu.device.wait()
        elapsed += time.perf_counter() - chunk
        steps += 25
        error = band_errors(field, points, reference, 5.0)["mean_abs_error_mm"]
        progress(f"sdf fit: {steps} steps, {elapsed:.1f} s, mean |s - B| {error:.3f} mm", min(elapsed / budget, 1))
        if error <= 0.5:
            break
    race_rate = steps * fitter.batch / max(elapsed, 1e-9)
    race_levels = field.active_levels
    reached = error <= 0.5
    # Throughput with every level active (the race above trains coarse levels first, which is cheaper).
    fitter = SdfFitter(gpu, prepared, field, replace(fit_config, coarse_to_fine=0.0))
    rate = fit_rate(fitter, 10 if quick else 40)
    phase_rows = fit_phase_rows(fitter)
    comparison = []
    if field.cooperative or field.coop_vectors is not None:  # the same steps with the per-thread network
        setting = "NEURALRAYCAST_COOPERATIVE=0" if field.cooperative else "NEURALRAYCAST_COOPVEC=0"
        comparison = [BenchRow("sdf_fit", "points/s with the per-thread network", per_thread_fit_rate(fitter), "1/s",
                               f"same batch and loss, every level active (what {setting} runs)")]
    levels = len(layout.levels)
    return comparison + [
        BenchRow("sdf_fit", "field module load", load, "s", "first process on this machine compiles"),
        BenchRow("sdf_fit", "first step (compiles the fit kernels)", first, "s", "cached on disk after the first run"),
        BenchRow("sdf_fit", "points/s (forward + backward + Adam)", rate, "1/s",
                 f"batch {batch}, all {levels} levels active, Eikonal on every {fit_config.eikonal_every}th wave of "
                 f"32 points; geometry network {field.geometry_network}"),
        BenchRow("sdf_fit", "time to mean |s - B| <= 0.5 mm (5 mm band)" if reached
                 else f"mean |s - B| after {budget:.0f} s budget", elapsed if reached else error,
                 "s" if reached else "mm", f"{steps} steps of {fitter.batch} points, warm kernels, coarse to fine "
                 f"({race_levels} of {levels} levels active at the end; {race_rate:.3g} points/s)"),
    ] + phase_rows


def fit_phase_rows(fitter) -> list[BenchRow]:
    """Where a fit step's time goes: its phases, and the fit kernel with the Eikonal term carried by every wave
    and by none (what the term's three extra evaluations per point cost)."""
    from ..field.sdf_fit import SdfFitter

    phases = fitter.profile_steps()
    with kernel_clock(fitter.gpu) as kernels:
        for _ in range(10):
            fitter.step()
    kernels = kernels.per(10)
    rows = [BenchRow("sdf_fit", "step phases", sum(phases.values()) * 1e3, "ms",
                     "; ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in phases.items())
                     + f" (means of 10 steps of {fitter.batch} points, waits after each phase)"),
            BenchRow("sdf_fit", "step kernels (device timestamps)", kernels.total_ms, "ms",
                     f"{kernels.summary()} (means of 10 steps, no waits: kernel_clock.py)")]
    kernel = "fit kernel (forward + backward)"
    for label, every in (("every wave", 1), ("no wave", 1 << 30)):
        variant = SdfFitter(fitter.gpu, fitter.prepared, fitter.field, replace(fitter.config, eikonal_every=every))
        seconds = variant.profile_steps()[kernel]
        rows.append(BenchRow("sdf_fit", f"fit kernel, Eikonal term on {label}", seconds * 1e3, "ms",
                             f"{fitter.batch} points; {fitter.batch / seconds:.3g} points/s in the kernel"))
    return rows


def fit_rate(fitter, steps: int = 40) -> float:
    """Points/s of ``steps`` fit steps (forward + backward + Adam), after one that may compile."""
    fitter.step()
    fitter.gpu.device.wait()
    start = time.perf_counter()
    for _ in range(steps):
        fitter.step()
    fitter.gpu.device.wait()
    return steps * fitter.batch / (time.perf_counter() - start)


def per_thread_fit_rate(fitter, steps: int = 10) -> float:
    """Points/s of ``fitter``'s steps with the geometry network per thread instead of on tensor cores or
    cooperative vectors."""
    field = fitter.field
    previous, field.cooperative = field.cooperative, False
    vectors, field.coop_vectors = field.coop_vectors, None
    try:
        return fit_rate(fitter, steps)
    finally:
        field.cooperative, field.coop_vectors = previous, vectors


def bench_train(gpu: GpuContext, prepared, quick: bool, progress) -> list[BenchRow]:
    """The whole training (``standard`` preset; ``quick`` with its downsampled study and small views):
    training rays/s (stages 2 and 3: forward + backward + Adam), held-out PSNR over time, geometry scores,
    and the neural render's frame time at 512² and 1024² without and with mesh shadows (meshes of the
    learned surfaces), next to the reference renderer with volumetric shadows."""
    from ..field.field import NeuralField
    from ..render.camera import orbit_cameras
    from ..render.metrics import psnr
    from ..render.reference_render import ReferenceRenderer
    from ..train.evaluate import geometry_metrics, shown
    from ..train.presets import RunSettings
    from ..train.run_folder import prepare_for_run, reference_views_for_run
    from ..train.trainer import Trainer, learned_mesh_shadows

    # train_study's steps, taken one at a time so that each is timed apart
    settings = RunSettings.for_device(gpu, "quick" if quick else "standard")
    name = settings.preset
    prepared = prepare_for_run(prepared.study, settings)
    shape = "x".join(map(str, prepared.study.shape))
    size = settings.size
    views = reference_views_for_run(gpu, prepared, settings)
    # As a run does on a GPU: the training's kernels compiled first, in processes side by side, where this
    # machine has not compiled them yet; not part of the training's time.
    warm_up, warm_up_note = 0.0, "not on a CPU device: it compiles in the training's own process"
    if not gpu.report.software:
        from ..train.warmup import ensure_warm

        clock = time.perf_counter()
        ran = ensure_warm(gpu, prepared.study, prepared, settings,
                          lambda message, fraction: progress(f"warm-up: {message}", fraction))
        warm_up = time.perf_counter() - clock if ran is not None else 0.0
        warm_up_note = ("this machine's first training of this preset: its kernels compiled in processes side by "
                        "side, as `neuralraycast run` does" if warm_up
                        else "none needed: the kernels were compiled already")
    field = NeuralField(gpu, settings.field_layout(gpu, prepared), seed=settings.seed)
    trainer = Trainer(gpu, prepared, field, views, settings.schedule())
    memory = {"field and trainer made": device_memory_in_use(gpu)}
    log = trainer.run(lambda message, fraction: progress(f"train: {message}", fraction))
    memory["training done"] = device_memory_in_use(gpu)
    scores = [row for row in log.rows if "heldout_psnr" in row]
    rows = [
        BenchRow("train", "warm-up before training", warm_up, "s", warm_up_note),
        BenchRow("train", "training rays/s (render stages)", log.rays_per_second(), "1/s",
                 f"preset {name}, {trainer.config.patches} patches of {trainer.config.patch_size}² per step; "
                 f"geometry network {field.geometry_network}"),
        BenchRow("train", "training rays/s, stage 2 (appearance only)", log.rays_per_second(2), "1/s",
                 "geometry frozen: the appearance network's backward only"),
        BenchRow("train", "training rays/s, stage 3 (joint)", log.rays_per_second(3), "1/s",
                 "backward through distances, difference normals and appearance"),
        BenchRow("train", "training rays/s after each stage's first step", log.rays_per_second(after_first_step=True),
                 "1/s", f"stage 2 {log.rays_per_second(2, True):,.0f}, stage 3 {log.rays_per_second(3, True):,.0f}: "
                 "the steps that only train"),
        BenchRow("train", "first step of stages 2 / 3", 1e3 * sum(log.first_step_seconds.values()), "ms",
                 " / ".join(f"{1e3 * log.first_step_seconds.get(stage, 0.0):.0f}" for stage in (2, 3))
                 + " ms: their kernels loaded and their calls set up, in the rates above"),
        BenchRow("train", "total training time", log.seconds, "s",
                 f"{trainer.config.geometry.steps} + {trainer.config.appearance_steps} + "
                 f"{trainer.config.joint_steps} steps, {size}² views, study {shape}"),
        BenchRow("train", "held-out PSNR at the end", scores[-1]["heldout_psnr"], "dB",
                 f"SSIM {scores[-1]['heldout_ssim']:.4f}, {len(views.held_out)} views"),
    ]
    for target in (28.0, 35.0):
        reached = next((row for row in scores if row["heldout_psnr"] >= target), None)
        seconds = reached["seconds"] if reached else float("nan")
        rows.append(BenchRow("train", f"time to held-out {target:.0f} dB", seconds, "s",
                             "" if reached else "not reached"))
    geometry = geometry_metrics(field, prepared)
    for structure, values in geometry.items():
        rows.append(BenchRow("train", f"{structure}: Dice", values["dice"], "",
                             f"mean surface distance {shown(values['mean_surface_distance_mm'], '.2f')} mm, "
                             f"HD95 {shown(values['hd95_mm'], '.2f')} mm"))
    renderer = trainer.renderer
    clock = time.perf_counter()
    shadows = learned_mesh_shadows(gpu, prepared, field, trainer.style)
    mesh_seconds = time.perf_counter() - clock
    rows.append(BenchRow("train", "learned meshes + BVH for shadows", mesh_seconds, "s",
                         f"{len(shadows.bvh.triangle_ids)} triangles: marching cubes of the learned SDF on the "
                         "study grid, LBVH"))
    for joint, stage in ((False, 2), (True, 3)):
        phases = trainer.profile_steps(joint=joint)
        rows.append(BenchRow("train", f"stage-{stage} step phases", sum(phases.values()) * 1e3, "ms",
                             "; ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in phases.items())
                             + " (means of 10 steps, waits after each phase)"))
    # How a joint step's rate falls with fewer rays per step than the standard preset's 128 patches (the device
    # is not full); on a slow device (quick) a step of 64 patches takes seconds, so there only the preset's
    # batch is profiled.
    for patches in () if quick else (16, 64):
        rays = patches * trainer.config.patch_size ** 2
        seconds = sum(trainer.profile_steps(joint=True, patches=patches).values())
        rows.append(BenchRow("train", f"stage-3 training rays/s, {rays} rays per step", rays / seconds, "1/s",
                             f"{patches} patches; one step {seconds * 1e3:.1f} ms (sum of the phases)"))
        memory[f"steps of {rays} rays"] = device_memory_in_use(gpu)
    config = trainer.config
    clock = time.perf_counter()
    coarse = learned_mesh_shadows(gpu, prepared, field, trainer.style, config.mesh_grid_mm)
    training_mesh_seconds = time.perf_counter() - clock
    joint_step = log.stage_seconds.get(3, 0.0) / max(config.joint_steps, 1)
    rows.append(BenchRow("train", f"re-extraction every {config.mesh_every} joint steps (training with shadows)",
                         100.0 * training_mesh_seconds / (config.mesh_every * joint_step) if joint_step
                         else float("nan"), "%",
                         f"of stage-3 time; one joint step {joint_step * 1e3:.1f} ms; meshes on a grid at most "
                         f"{config.mesh_grid_mm:g} mm apart: {training_mesh_seconds:.2f} s, "
                         f"{len(coarse.bvh.triangle_ids)} triangles"))
    reference = ReferenceRenderer(gpu, prepared)
    trainer.use_picture_settings()  # the finished field's pictures, as a run renders them
    for width in (512,) if quick else (512, 1024):
        camera = orbit_cameras(prepared.bounds, 3, width, width)[1]
        budget, repeats_max = (0.5, 3) if quick else (3.0, 20)
        frame = {}
        for label, shadow in (("no shadows", None), ("mesh shadows", shadows)):
            renderer.set_mesh_shadows(shadow)
            frame[label] = renderer.render(camera)
            each = timed_each(lambda c=camera: renderer.render(c), budget, repeats_max)
            rows.append(BenchRow("train", f"neural render {width}² ({label})", 1e3 * float(np.mean(each)), "ms",
                                 f"{frame_notes(each)}; {renderer.max_samples} samples/ray max; geometry "
                                 f"network {field.geometry_network}"))
        passes: dict[str, float] = {}
        renderer.render(camera, timings=passes)  # with mesh shadows: where a frame's time goes
        rows.append(BenchRow("train", f"neural render {width}² passes", sum(passes.values()) * 1e3, "ms",
                             "; ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in passes.items())
                             + "; per ray {:.1f} samples, {:.2f} shaded segments (waits after each pass)".format(
                                 *work_per_ray(renderer, camera))))
        with kernel_clock(gpu) as kernels:
            renderer.render(camera)
        rows.append(BenchRow("train", f"neural render {width}² kernels (device timestamps)", kernels.total_ms, "ms",
                             f"{kernels.summary()}; from the first kernel's start to the last one's end "
                             f"{kernels.span_ms:.1f} ms (with mesh shadows, no waits: kernel_clock.py)"))
        renderer.set_mesh_shadows(None)
        volumetric = reference.render(camera, shadows=True)
        seconds, repeats = timed(lambda c=camera: reference.render(c, shadows=True), budget, repeats_max)
        rows.append(BenchRow("train", f"reference render {width}² (volumetric shadows)", seconds * 1e3, "ms",
                             f"{repeats} runs; PSNR of the neural render with mesh shadows against it: "
                             f"{psnr(frame['mesh shadows'].rgb(), volumetric.rgb()):.2f} dB"))
        memory[f"{width}² renders"] = device_memory_in_use(gpu)
    return rows + [memory_row(memory, memory_budget(gpu))]


def memory_row(samples: dict[str, int | None], budget: MemoryBudget | None = None) -> BenchRow:
    """The largest of the device memory samples (bytes in use on the GPU, sampled between the bench's parts,
    not a true peak), with every sample in the notes; NaN where the device does not tell (CUDA only). The notes
    name the ``budget`` the work was sized to (``--gpu-memory``)."""
    known = {name: value for name, value in samples.items() if value is not None}
    under = "" if budget is None else f"; sized to {budget.describe()}"
    if not known:
        return BenchRow("train", "GPU memory in use", float("nan"), "GiB",
                        f"not readable on this device (CUDA only){under}")
    largest = max(known, key=lambda name: known[name])
    return BenchRow("train", "GPU memory in use, largest sample", known[largest] / 2**30, "GiB",
                    f"after {largest}; " + ", ".join(f"{name} {value / 2**30:.2f}" for name, value in known.items())
                    + f" GiB (the device's total less free, this process's context included){under}")


def work_per_ray(renderer, camera) -> tuple[float, float]:
    """Mean samples placed and segments shaded per ray of a camera's picture (what the distance and the
    normals-and-appearance passes scale with)."""
    samples = shaded = 0
    for _first, _rows, batch in renderer.camera_bands(camera):
        samples += int(renderer.sample_counts(batch).sum())
        shaded += batch.lists.shaded
    pixels = camera.width * camera.height
    return samples / pixels, shaded / pixels


def surface_errors(vertices, faces, exact) -> np.ndarray:
    """|exact SDF| at a mesh's vertices and face centroids: the distance of the surface to the true one."""
    points = np.concatenate([vertices, vertices[faces].mean(axis=1)]) if len(faces) else vertices
    return np.abs(exact(points))


def slicer_smoothing(vertices: np.ndarray, faces: np.ndarray, with_vtk: bool) -> tuple[np.ndarray, np.ndarray]:
    """The smoothing of Slicer's closed-surface conversion at its default smoothing factor 0.5 (VTK's
    windowed sinc, 20 iterations, pass band 10⁻²); without VTK, the same kind of filter in numpy."""
    if with_vtk:
        from ..mesh.mesh import smooth

        return smooth(vertices, faces, iterations=20, passband=0.01)
    from ..mesh.surface_distance import smooth_surface

    return smooth_surface(vertices, faces, iterations=20, passband=0.01), faces


#: The phantom's label maps the mesh accuracy is measured on: exact, as people draw them, and as drawn on
#: 5 mm slices (label style, grid spacing in mm).
MESH_ACCURACY_LABELS = (("clean", 2.0), ("ragged", 2.0), ("ragged", (1.5, 1.5, 5.0)))


def bench_mesh_accuracy(gpu: GpuContext, prepared, quick: bool, progress) -> list[BenchRow]:
    """Meshes of the learned SDF against the classic route (marching cubes on the label map, with and
    without the windowed-sinc smoothing of Slicer's closed-surface conversion), on the analytic phantom
    whose exact distances are known, for each of :data:`MESH_ACCURACY_LABELS`. The learned surfaces come from
    a stage-1 fit to the boundary maps, meshed on a grid twice as fine as the study's."""
    rows = []
    for labels_drawn, spacing in MESH_ACCURACY_LABELS:
        grid = "×".join(f"{s:g}" for s in spacing) if isinstance(spacing, tuple) else f"{spacing:g}"
        rows += _mesh_accuracy(gpu, quick, progress, labels_drawn, spacing, f"{labels_drawn} labels, {grid} mm: ")
    return rows


def _mesh_accuracy(gpu: GpuContext, quick: bool, progress, labels_drawn: str, spacing, case: str
                   ) -> list[BenchRow]:
    """:func:`bench_mesh_accuracy` on one of the phantom's label maps (rows named after ``case``)."""
    from ..field.field import FieldLayout, NeuralField
    from ..field.sdf_fit import FitConfig, SdfFitter
    from ..mesh.mesh import extract_surface, mesh_structure, refined_grid, resample_sdf
    from ..study.preprocess import prepare, structure_mask
    from ..study.sample import cached_sample
    from ..study.sample.phantom import Phantom
    from ..study.study import load_study

    with_vtk = importlib.util.find_spec("vtk") is not None
    smoothed_route = "label map, marching cubes + smoothing"
    smoothed_route += "" if with_vtk else " (numpy windowed sinc: no VTK here)"
    phantom = Phantom()
    study = prepare(load_study(cached_sample("phantom", spacing, labels_drawn=labels_drawn)))
    layout = FieldLayout.for_study(study, small=gpu.report.software)
    field = NeuralField(gpu, layout, seed=0)
    config = FitConfig(steps=300, batch=1 << 13) if quick else FitConfig(steps=1000, batch=1 << 16)
    start = time.perf_counter()
    SdfFitter(gpu, study, field, config).run(lambda message, fraction: progress(f"mesh accuracy: fit {message}",
                                                                               fraction))
    fit_seconds = time.perf_counter() - start
    fine_affine, fine_shape = refined_grid(study.affine, study.study.shape, 2)
    start = time.perf_counter()
    learned = resample_sdf(field.distances, fine_affine, fine_shape)
    rows = [BenchRow("mesh_accuracy", f"{case}stage-1 fit of the phantom", fit_seconds, "s",
                     f"{config.steps} steps of {config.batch} points"),
            BenchRow("mesh_accuracy", f"{case}learned SDF on the 2× grid", time.perf_counter() - start, "s",
                     f"{int(np.prod(fine_shape))} points")]
    for k, structure in enumerate(study.structures):
        def exact(points, name=structure.name):
            return phantom.sdf(name, points)

        start = time.perf_counter()
        mesh = mesh_structure(learned[k], fine_affine, structure.name, structure.color)
        extract_seconds = time.perf_counter() - start
        mask = structure_mask(structure, study.study.labels, study.mask)
        blocky = extract_surface(0.5 - mask.astype(np.float32), study.affine)
        routes = {
            "learned SDF, marching cubes on the 2× grid": (mesh.vertices, mesh.faces),
            "label map, marching cubes": blocky,
            smoothed_route: slicer_smoothing(*blocky, with_vtk),
        }
        means = {}
        for route, (vertices, faces) in routes.items():
            errors = surface_errors(vertices, faces, exact)
            means[route] = float(errors.mean())
            rows.append(BenchRow("mesh_accuracy", f"{case}{structure.name}: {route}", means[route], "mm",
                                 f"mean distance to the exact surface; 95th percentile "
                                 f"{np.percentile(errors, 95):.3f} mm; {len(faces)} triangles"))
        learned_mean = max(means["learned SDF, marching cubes on the 2× grid"], 1e-9)
        rows.append(BenchRow("mesh_accuracy", f"{case}{structure.name}: label map / learned distance",
                             means["label map, marching cubes"] / learned_mean, "×",
                             f"target ≥ 2; extraction {extract_seconds:.2f} s"))
        rows.append(BenchRow("mesh_accuracy", f"{case}{structure.name}: smoothed label map / learned distance",
                             means[smoothed_route] / learned_mean, "×",
                             "the classic route with Slicer's closed-surface smoothing"))
    return rows


def bench_startup(gpu: GpuContext, prepared, quick: bool, progress) -> list[BenchRow]:
    """How long a second run waits before it trains: ``fit``'s start (imports, device, study, reference
    views, field, first SDF-fit and joint steps) timed twice in fresh processes on the built-in icbm sample
    with this device's default preset; the second run finds every cache warm (issue target: ≤ 1 s). Then
    the same start twice in this process, as a second run in Slicer starts (the device open, the kernels
    loaded by the first)."""
    from ..study.sample import cached_sample
    from .startup import MILESTONES, start_in_process, timed_start

    study = cached_sample("icbm")
    progress("startup: first run (fills the caches)", 0.0)
    first = timed_start(study, device=gpu.backend)
    progress("startup: second run", 0.5)
    second = timed_start(study, device=gpu.backend)
    seconds = second["seconds"]
    rows = [BenchRow("startup", f"second run: {name}", seconds[name], "s", "since the process was started")
            for name in MILESTONES]
    views = f"{second['views']} views of {second['size']}²"
    first_joint = first["seconds"]["first joint step"]
    rows.append(BenchRow("startup", "second run: training starts after", seconds["field and trainer"], "s",
                         f"preset {second['preset']}, {views} (read from the view cache); the first run (caches "
                         f"as they were) reached its first joint step after {first_joint:.1f} s"))
    progress("startup: two runs in this process", 0.8)
    start_in_process(gpu, study)
    again = start_in_process(gpu, study)
    rows += [BenchRow("startup", f"second run in the same process: {name}", again[name], "s",
                      "since the run was asked for") for name in MILESTONES if name in again]
    rows.append(BenchRow("startup", "second run in the same process: training starts after",
                         again["field and trainer"], "s", "the device open and the kernels loaded, as in Slicer"))
    return rows


def bench_prepare(gpu: GpuContext, prepared, quick: bool, progress) -> list[BenchRow]:
    """Preparing the study afresh on the CPU, as ``neuralraycast prepare --no-cache`` does (brain mask,
    boundary maps, P(x), occupancy, normalised channels), and the brain mask and boundary maps alone (issue
    target for those: ≤ 5 s on two cores for a 240×240×155 study with four structures): the fastest of a few
    runs, wall clock and processor time."""
    import os

    from ..study.preprocess import mask_and_boundary_maps, prepare
    from ..study.structures import make_structures

    study = prepared.study
    structures = make_structures(study.structures, include_brain=True, colors=study.colors)
    runs = 1 if quick else 3
    parts = {"prepare without cache": lambda: prepare(study, use_cache=False),
             "brain mask and boundary maps": lambda: mask_and_boundary_maps(study, structures, lambda m, f: None)}
    rows = []
    for index, (name, work) in enumerate(parts.items()):
        best = (float("inf"), float("inf"))
        for run in range(runs):
            progress(f"prepare: {name}, run {run + 1} of {runs}", (index * runs + run) / (len(parts) * runs))
            wall, processor = time.perf_counter(), time.process_time()
            work()
            best = min(best, (time.perf_counter() - wall, time.process_time() - processor))
        rows.append(BenchRow("prepare", name, best[0], "s",
                             f"fastest of {runs}; processor time {best[1]:.1f} s on {os.cpu_count()} cores; "
                             f"{' × '.join(map(str, study.shape))} voxels, {len(structures)} structures"))
    return rows


#: Kernels reported by the ``kernels`` suite, the largest first.
KERNEL_ROWS = 10


def bench_kernels(gpu: GpuContext, prepared, quick: bool, progress) -> list[BenchRow]:
    """Registers, spills and shared memory of the CUDA kernels compiled so far (``ptxas -v`` on the PTX the
    shader cache keeps: run this suite after those whose kernels it should see), the largest first, and the
    warps an SM holds of each (kernel_resources.py says why this stands in for a profiler)."""
    from .kernel_resources import find_ptxas, ptx_programs, ptxas_resources

    if gpu.backend != "cuda":
        return [BenchRow("kernels", "not measured", float("nan"), "",
                         f"ptxas reads CUDA kernels; this device is {gpu.backend}")]
    capability = gpu.report.compute_capability  # read once when the device opened
    ptxas, architecture = find_ptxas(), f"sm_{capability}" if capability else None
    if ptxas is None or architecture is None:
        why = "needs the CUDA toolkit's ptxas" if ptxas is None else "no CUDA compute capability found"
        return [BenchRow("kernels", "not measured", float("nan"), "", why)]
    programs = ptx_programs(gpu.report.shader_cache)
    rows = [BenchRow("kernels", "kernels in the shader cache", len(programs), "",
                     f"PTX programs, the {min(KERNEL_ROWS, len(programs))} largest below, assembled for "
                     f"{architecture}")]
    for index, ptx in enumerate(programs[:KERNEL_ROWS]):
        progress(f"kernels: ptxas on kernel {index + 1}", index / KERNEL_ROWS)
        kernel = ptxas_resources(ptx, architecture, ptxas)
        rows.append(BenchRow("kernels", f"kernel {index + 1}: registers a thread", kernel.registers, "",
                             f"PTX {kernel.ptx_bytes / 1024:.0f} KB; spill stores / loads {kernel.spill_stores} / "
                             f"{kernel.spill_loads} bytes; shared memory {kernel.shared_bytes} bytes; "
                             f"{kernel.warps_per_sm()} of 64 warps per SM in slangpy's groups of 32 threads"))
    return rows


SUITES: dict[str, Callable] = {"reference": bench_reference, "sdf_fit": bench_sdf_fit, "train": bench_train,
                               "mesh_accuracy": bench_mesh_accuracy, "torch_peer": bench_torch_peer,
                               "startup": bench_startup, "prepare": bench_prepare, "workstation": bench_workstation,
                               "branches": bench_branches, "kernels": bench_kernels}


def run_bench(gpu: GpuContext, prepared, study_name: str, suites: list[str], quick: bool, command: str,
              progress=None) -> BenchReport:
    report = progress or (lambda message, fraction: None)
    unknown = set(suites) - set(SUITES)
    if unknown:
        raise ValueError(f"unknown benchmark suite(s) {sorted(unknown)}; choose from {sorted(SUITES)}")
    result = BenchReport(
        date=datetime.date.today().isoformat(), device=gpu.report.as_dict(), command=command, study=study_name
    )
    for suite in suites:
        try:
            result.rows += SUITES[suite](gpu, prepared, quick, report)
        except Exception as error:  # one broken suite must not lose the others' numbers
            result.rows.append(BenchRow(suite, "failed", float("nan"), "", " ".join(str(error).split())[:200]))
    report("done", 1.0)
    return result
