"""``neuralraycast demo``: the main job on the built-in sample case, into one output folder.

sample study → train (standard preset on a GPU, quick on a software device) → held-out comparisons
→ turntable (PNG frames + GIF) → meshes of the learned surfaces → metrics → ``report.html``.
With ``--branches field gaussians`` the Gaussians are trained on the same views after the field, and the report
sets the two side by side.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import numpy as np

from .. import __version__, strict_json
from ..files import write_text
from ..gpu.device import memory_budget, open_device
from ..mesh.mesh import write_meshes
from ..outputs import check_output
from ..progress import Cancelled, CancelOnInterrupt, ConsoleProgress
from ..render.camera import orbit_cameras
from ..render.metrics import depth_picture, normal_picture, psnr, save_png
from ..study.sample import write_sample
from ..train.evaluate import shown
from ..train.presets import AUTO, RunSettings, check_run_values, get_preset
from ..train.run import train_study
from ..train.run_folder import run_metrics
from .report import branch_column, save_comparison, save_gif, write_report
from .share import write_page


def turntable_cameras(bounds: np.ndarray, frames: int, size: int) -> list:
    """Cameras circling the study at a fixed elevation (orbit cameras share the framing rule)."""
    from dataclasses import replace

    base = orbit_cameras(bounds, 1, size, size, elevation_range=(20.0, 20.0))[0]
    centre = np.asarray(base.focal_point, np.float64)
    offset = np.asarray(base.position, np.float64) - centre
    radius, height = np.hypot(offset[0], offset[1]), offset[2]
    return [replace(base, position=tuple(centre + [radius * np.cos(a), radius * np.sin(a), height]))
            for a in np.linspace(0, 2 * np.pi, frames, endpoint=False)]


#: The representations the demo can train; the field always, the Gaussians beside it on request.
BRANCHES = ("field", "gaussians")


def check_branches(branches: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The branches asked for, in the demo's order; the report is built around the field, so it must be one."""
    unknown = [branch for branch in branches if branch not in BRANCHES]
    if unknown or "field" not in branches:
        raise ValueError(f"--branches {' '.join(branches)}: the demo trains the field and, beside it, the Gaussians; "
                         "give 'field' or 'field gaussians'")
    return tuple(branch for branch in BRANCHES if branch in branches)


def frame_ms(render, camera, repeats: int = 3) -> float:
    """Mean milliseconds of a picture with read-back, after one that may compile."""
    render(camera)
    start = time.perf_counter()
    for _ in range(repeats):
        render(camera)
    return 1e3 * (time.perf_counter() - start) / repeats


def run_demo(out: str | Path, device: str | None = None, case: str = "icbm", spacing: float | None = None,
             seed: int = 0, preset_name: str | None = None, warm_up_first: bool = True,
             overwrite: bool = False, gpu_memory: str | None = None,
             branches: tuple[str, ...] | list[str] = ("field",)) -> Path:
    """Run the demo into ``out`` (checked first: a non-empty folder only with ``overwrite``); returns the
    report's path. ``gpu_memory``: the GPU memory budget (``--gpu-memory``; gpu/memory_budget.py).
    ``branches``: with ``gaussians``, the Gaussians are trained on the same views too and the report gives a
    column per branch. A training cancelled (Ctrl-C) keeps its state and raises :class:`Cancelled` saying where."""
    check_run_values(seed=seed)
    branches = check_branches(branches)
    out = check_output(out, overwrite=overwrite)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    gpu = open_device(device) if gpu_memory is None else open_device(device, gpu_memory)
    print(gpu.report.as_text(), flush=True)
    print(f"memory budget      {memory_budget(gpu).describe()}", flush=True)
    settings = RunSettings.for_device(gpu, preset_name, seed=seed).check()
    out.mkdir(parents=True, exist_ok=True)
    note = ""
    if preset_name in (None, AUTO) and gpu.report.software:
        note = (f"No GPU was found: the preset {get_preset(settings.preset).describe()} ran on the CPU; "
                "a GPU runs the standard preset at full resolution.")
        print(note, flush=True)

    clock = time.perf_counter()
    manifest = write_sample(out / "study", case, spacing, seed, ConsoleProgress(f"sample {case}"))
    timings["sample study"] = time.perf_counter() - clock

    clock = time.perf_counter()
    with CancelOnInterrupt() as cancel:
        run = train_study(gpu, manifest, out / "run", settings, ConsoleProgress(f"train ({settings.preset})"), cancel,
                          warm_up=warm_up_first, overwrite=overwrite)
    if run.log.cancelled:
        raise Cancelled(f"cancelled; the state reached is saved in {run.folder}")
    timings["prepare, reference views and training"] = time.perf_counter() - clock
    renderer = run.renderer

    clock = time.perf_counter()
    progress = ConsoleProgress("pictures")
    held_out, rendered = [], {}
    for index in run.views.held_out:
        reference = run.views.images[index].rgb()
        neural = rendered[index] = renderer.render(run.views.cameras[index]).rgb()
        held_out.append(save_comparison(out, index, reference, neural, psnr(neural, reference)))
    frames = []
    frames_count = 12 if gpu.report.software else 24  # a CPU device renders slowly
    cameras = turntable_cameras(run.prepared.bounds, frames_count, settings.size)
    for index, camera in enumerate(cameras):
        progress(f"turntable {index + 1}/{len(cameras)}", index / len(cameras))
        image = renderer.render(camera)
        frames.append(image.rgb())
        save_png(frames[-1], out / "turntable" / f"{index:03d}.png")
        if index == 0:
            save_png(depth_picture(image.depth), out / "gbuffer_depth.png")
            save_png(normal_picture(image.normal), out / "gbuffer_normal.png")
    save_gif(frames, out / "turntable.gif")
    progress("done", 1.0)
    timings["held-out renders and turntable"] = time.perf_counter() - clock
    clock = time.perf_counter()
    write_page(run, out / "live.html")  # the report's live view
    timings["live view page"] = time.perf_counter() - clock

    clock = time.perf_counter()
    meshes = []
    try:
        learned = [mesh for mesh in run.meshes(smoothing_iterations=10) if len(mesh.faces)]
        paths = write_meshes(learned, out / "meshes")  # all or none
        meshes += [{"name": mesh.name, "triangles": len(mesh.faces), "file": str(path.relative_to(out))}
                   for mesh, path in zip(learned, paths, strict=True)]
    except ImportError as error:  # VTK missing (a bare server install): everything else still gets reported
        meshes.append({"name": "(meshes skipped)", "triangles": 0, "file": f"VTK not available: {error}"})
    timings["meshes of the learned surfaces"] = time.perf_counter() - clock

    clock = time.perf_counter()
    metrics = run_metrics(gpu, run.folder, run.prepared, run.field, run.views, settings, renderer, rendered)
    write_text(out / "metrics.json", strict_json.dumps(metrics, indent=2) + "\n")
    timings["evaluation"] = time.perf_counter() - clock
    columns = {}
    if "gaussians" in branches:  # a field-only demo times no frames: its time stays as it was
        clock = time.perf_counter()
        columns["field"] = branch_column(metrics, frame_ms(renderer.render, run.views.cameras[held_out[0]["view"]]))
        columns["gaussians"] = gaussian_branch(gpu, manifest, out, settings, run.views, held_out, overwrite)
        timings["Gaussians: training, evaluation and pictures"] = time.perf_counter() - clock
    timings["total"] = time.perf_counter() - started

    import slangpy

    report = write_report(out, {
        "study": f"{case} sample, {'x'.join(map(str, run.prepared.study.shape))} voxels",
        "metrics": metrics, "log_rows": run.log.rows, "timings": timings, "meshes": meshes,
        "preset_note": note, "branches": columns,
        "pictures": {"held_out": held_out, "turntable": "turntable.gif", "live": "live.html",
                     "depth": "gbuffer_depth.png", "normal": "gbuffer_normal.png"},
        "versions": {"SlicerNeuralRaycast": __version__, "slangpy": slangpy.__version__,
                     "Python": platform.python_version(), "device": gpu.report.adapter, "backend": gpu.backend},
    })
    print(f"held-out PSNR {shown(metrics['heldout_psnr'], '.2f')} dB, SSIM {shown(metrics['heldout_ssim'], '.4f')}; "
          + ", ".join(f"Dice {name} {value:.3f}" for name, value in metrics["dice"].items()))
    if "gaussians" in columns:
        gaussians = columns["gaussians"]
        print(f"Gaussians: held-out PSNR {shown(gaussians['heldout_psnr'], '.2f')} dB, SSIM "
              f"{shown(gaussians['heldout_ssim'], '.4f')}; "
              + ", ".join(f"Dice {name} {shown(value, '.3f')}" for name, value in gaussians["dice"].items()))
    print(f"total {timings['total']:.0f} s")
    return report


def gaussian_branch(gpu, manifest: Path, out: Path, settings: RunSettings, views, held_out: list[dict],
                    overwrite: bool = False) -> dict:
    """The Gaussians trained with the field's settings into ``out/gaussians``, scored by their ``evaluate``; each
    held-out comparison gets their picture beside the field's. Returns their column of the report."""
    from ..gaussians.run import evaluate_gaussian_run, fit_gaussians

    with CancelOnInterrupt() as cancel:
        run = fit_gaussians(gpu, manifest, out / "gaussians", settings, ConsoleProgress("train (Gaussians)"), cancel,
                            overwrite=overwrite)
    if run.log.cancelled:
        raise Cancelled(f"cancelled; the Gaussians' state reached is saved in {run.folder}")
    for comparison in held_out:
        camera = views.cameras[comparison["view"]]
        picture = run.render(camera).rgb()
        comparison["gaussians"] = f"compare/{comparison['view']:03d}_gaussians.png"
        comparison["gaussians_psnr"] = psnr(picture, views.images[comparison["view"]].rgb())
        save_png(picture, out / comparison["gaussians"])
    milliseconds = frame_ms(run.scene.render, views.cameras[held_out[0]["view"]])  # no padded depth nor normals
    metrics = evaluate_gaussian_run(gpu, run.folder, ConsoleProgress("evaluate (Gaussians)"))
    return branch_column(metrics, milliseconds)
