"""The ``neuralraycast`` command line: the same backend the Slicer module uses, for scripts and servers."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from .. import __version__, strict_json
from ..files import WriteError
from ..gpu.device import CHOICES, DEVICE_ENV, GpuMemoryError, GpuUnavailableError, open_device, requested_backend
from ..gpu.memory_budget import GPU_MEMORY_ENV, LOWER, parse_memory
from ..gpu.platforms import UnsupportedPlatformError, check_platform
from ..outputs import check_output
from ..paths import CACHE_FOLDERS
from ..progress import Cancelled, ConsoleProgress
from ..study.drawn_labels import MIN_PIECE_ML, check_min_piece_ml
from ..study.sample import CASES
from ..study.sample.icbm import SampleDataError
from ..study.sample.label_style import STYLES as LABEL_STYLES
from ..study.study import StudyError
from ..train.presets import AUTO, PRESETS, check_run_values, get_preset, presets_help
from ..train.trainer import TrainingError
from .standby import WARM_CHOICES, serve

#: Errors that are the user's or the machine's, not a bug: one line, exit status 2. The file system's and the
#: memory's (a full disk, a read-only folder, too large a study) are among them.
USER_ERRORS = (StudyError, GpuUnavailableError, GpuMemoryError, SampleDataError, OSError, MemoryError, ValueError,
               TrainingError, UnsupportedPlatformError)

#: Whether the measurement code (NeuralRaycastLib/bench, left out of the Slicer extension) is here: the
#: ``bench`` command is offered only then.
HAS_BENCH = importlib.util.find_spec(f"{__package__.rpartition('.')[0]}.bench") is not None

#: Exit statuses, as the help's epilog lists them.
EXIT_DONE, EXIT_ERROR, EXIT_CANCELLED = 0, 2, 130
EXIT_STATUSES = (f"exit status: {EXIT_DONE} done; {EXIT_ERROR} bad input or environment (one line on standard error "
                 f"says what is wrong and what to do); {EXIT_CANCELLED} cancelled (Ctrl-C; 'fit' and 'demo' keep the "
                 "state reached and say where)")

#: What to do about a file system error, by its errno's name (not every platform has every name).
_OS_ADVICE = {getattr(errno, name): advice for name, advice in (
    ("ENOSPC", "free some space there or choose another folder"),
    ("EDQUOT", "free some space there or choose another folder"),
    ("EACCES", "check its permissions or choose a writable folder"),
    ("EPERM", "check its permissions or choose a writable folder"),
    ("EROFS", "choose a writable folder"),
    ("ENOENT", "check the path"),
    ("EEXIST", "choose another name or remove it"),
    ("EISDIR", "a folder is there; give the path of a file"),
    ("ENOTDIR", "a part of the path is a file, not a folder; check the path"),
    ("ELOOP", "symbolic links there point at each other; check the path"),
    ("ENAMETOOLONG", "choose a shorter path"),
    ("ENOTEMPTY", "choose a new or empty folder"),
    ("EMFILE", "too many files are open; close some programs or raise the limit (ulimit -n)"),
    ("ENFILE", "too many files are open; close some programs or raise the limit (ulimit -n)"),
    ("EIO", "the disk failed to read or write; check it or choose another folder"),
    ("ENOMEM", "close other programs, or use a smaller study or preset (--preset quick)"),
) if hasattr(errno, name)}


def one_line(text: str) -> str:
    """``text`` on one line: a message built from another library's can span several."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def describe_error(error: BaseException) -> str:
    """The one line a user is shown for ``error``: a file system error names the path, what failed and what
    to do; a memory error what to do; others are their own message."""
    if isinstance(error, WriteError):  # its own line names the result's path (not a temporary) and what to do
        return one_line(str(error))
    if isinstance(error, MemoryError):
        detail = f" ({error})" if str(error) else ""
        return one_line(f"not enough memory{detail}; close other programs, or use a smaller study or preset "
                        "(--preset quick)")
    if isinstance(error, OSError) and error.errno is not None and error.strerror:
        where = "" if error.filename is None else f"{error.filename}: "
        if error.filename2 is not None:
            where = f"{error.filename} -> {error.filename2}: "
        return one_line(f"{where}{error.strerror}; {_OS_ADVICE.get(error.errno, 'check the path and try again')}")
    return one_line(str(error)) or type(error).__name__


def _print_json(data) -> None:
    print(strict_json.dumps(data, indent=2))


def _writes_to_descriptor_1(stream) -> bool:
    try:
        return stream.fileno() == 1
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured, embedded)
        return False


@contextlib.contextmanager
def _native_output_to_stderr() -> Iterator[None]:
    """While a ``--json`` command runs, file descriptor 1 points at standard error, so what native libraries
    print there (the shader compiler's warnings) cannot break the JSON a script reads; Python's
    ``sys.stdout``, which prints the JSON, keeps writing to the real standard output."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    original = sys.stdout
    if _writes_to_descriptor_1(original):
        sys.stdout = os.fdopen(os.dup(saved), "w")
    try:
        yield
    finally:
        if sys.stdout is not original:
            sys.stdout.close()
            sys.stdout = original
        os.dup2(saved, 1)
        os.close(saved)


def _device(args: argparse.Namespace):
    """The device the command asked for, with its GPU memory budget: ``--gpu-memory`` where given, else the one
    open_device finds ($NEURALRAYCAST_GPU_MEMORY, the device's)."""
    memory = getattr(args, "gpu_memory", None)
    return open_device(args.device) if memory is None else open_device(args.device, memory)


def cmd_info(args: argparse.Namespace) -> int:
    # The platform first: where slangpy has no wheel (or no device is known to open) say so and what is supported,
    # as the Slicer module does before it installs anything.
    support = check_platform(requested_backend(args.device))
    gpu = _device(args)
    if args.json:
        _print_json({**gpu.report.as_dict(), "memory_budget_bytes": gpu.memory.bytes,
                     "memory_budget_source": gpu.memory.source, "platform": support.describe()})
    else:
        print(f"platform           {support.describe()}")
        print(gpu.report.as_text())
        print(f"memory budget      {gpu.memory.describe()}")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from ..study.sample import write_sample

    check_run_values(seed=args.seed)
    manifest = write_sample(args.folder, args.case, args.spacing, args.seed, ConsoleProgress(f"sample {args.case}"),
                            labels_drawn=args.labels)
    print(manifest)
    return 0


def _spacing(text: str) -> float | tuple[float, float, float]:
    """A sample's voxel size: one number of mm, or three separated by commas."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a voxel size in mm: {text!r}") from None
    if len(values) not in (1, 3) or not all(0.0 < value < 100.0 for value in values):
        raise argparse.ArgumentTypeError(f"give one voxel size or three (i, j, k), each above 0 and below 100 mm "
                                         f"(got {text!r})")
    return values[0] if len(values) == 1 else (values[0], values[1], values[2])


def _millilitres(text: str) -> float:
    """A minimum piece size from the command line (argparse turns the ValueError into a usage error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of millilitres: {text!r}") from None
    try:
        return check_min_piece_ml(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _prepare(study_path: str, use_cache: bool, args: argparse.Namespace | None = None):
    from ..study.cache import load_study_cached
    from ..study.preprocess import prepare
    from ..study.study import load_study

    study = load_study_cached(study_path) if use_cache else load_study(study_path)
    pieces = {} if args is None else {"min_piece_ml": args.min_piece_ml, "keep_small_pieces": args.keep_small_pieces}
    return prepare(study, use_cache=use_cache, progress=ConsoleProgress("prepare"), **pieces)


def cmd_prepare(args: argparse.Namespace) -> int:
    from ..study.summary import save_preview, study_summary, summary_text

    prepared = _prepare(args.study, not args.no_cache, args)
    summary = study_summary(prepared)
    if args.preview:
        summary["preview"] = str(save_preview(prepared, args.preview))
    if args.json:
        _print_json(summary)
    else:
        print(summary_text(summary))
        if args.preview:
            print(f"preview     {summary['preview']}")
    return 0


def cmd_render_reference(args: argparse.Namespace) -> int:
    from ..render.camera import check_view_split
    from ..render.reference_views import check_views_folder, render_reference_views, save_reference_views

    check_view_split(args.views, args.held_out_every)
    check_output(args.out, args.study, overwrite=args.overwrite)
    check_views_folder(args.out)  # before rendering, not after
    gpu = _device(args)
    prepared = _prepare(args.study, use_cache=True)
    views = render_reference_views(
        gpu, prepared, args.views, args.size[0], args.size[1], shadows=args.shadows, view_angle=args.view_angle,
        held_out_every=args.held_out_every, progress=ConsoleProgress(f"render {gpu.backend}"),
    )
    folder = save_reference_views(views, args.out)
    print(f"{len(views.images)} views ({len(views.held_out)} held out) in {folder}; see {folder / 'contact_sheet.png'}")
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    """All stages: geometry from the boundary maps, then appearance and joint training through the renderer."""
    from ..progress import CancelOnInterrupt
    from ..study.cache import load_study_cached
    from ..study.preprocess import import_map_libraries
    from ..train.presets import RunSettings
    from ..train.run import train_study
    from .worker import JsonLines, StopOnStdin

    # Bad options, outputs and studies fail at once, before the device opens (the study then read from the cache).
    check_run_values(seed=args.seed, views=args.views, iterations=args.iterations)
    check_output(args.out, args.study, overwrite=args.overwrite,
                 run_of=str(Path(args.study).expanduser().resolve()))
    # The boundary maps' libraries load while the study is read, and are loaded before the device opens: its open
    # holds the interpreter, so beside it they would make no way and run on into the maps.
    map_libraries = threading.Thread(target=import_map_libraries, name="import-map-libraries", daemon=True)
    map_libraries.start()
    load_study_cached(args.study)
    appearance = _pretrained_appearance(args)
    map_libraries.join()
    gpu = _device(args)
    settings = replace(RunSettings.for_device(gpu, args.preset, seed=args.seed, iterations=args.iterations,
                                              views=args.views, size=args.size, shadows=args.shadows,
                                              max_voxels=args.max_voxels),
                       min_piece_ml=args.min_piece_ml, keep_small_pieces=args.keep_small_pieces)
    if args.preset in (None, AUTO):
        where = "software device" if gpu.report.software else "GPU"
        print(f"{where}: preset {get_preset(settings.preset).describe()}", file=sys.stderr)
    if args.representation == "gaussians":
        return _fit_gaussians(gpu, args, settings)
    stream = JsonLines() if args.progress_json else None
    stdin_stop = StopOnStdin() if args.progress_json else None
    with CancelOnInterrupt() as cancel:
        should_stop = cancel if stdin_stop is None else (lambda: cancel() or stdin_stop())
        run = train_study(gpu, args.study, args.out, settings, stream or ConsoleProgress(f"fit {gpu.backend}"),
                          should_stop, warm_up=not args.no_warmup, overwrite=args.overwrite, appearance=appearance)
    log = run.log
    if stream is not None:
        stream.write({"event": "done", "run_folder": str(run.folder), "cancelled": bool(log.cancelled),
                      "seconds": log.seconds, "heldout_psnr": log.last("heldout_psnr")})
    if log.cancelled:
        raise Cancelled(f"cancelled after {log.seconds:.1f} s of training; the state reached is saved in {run.folder}")
    psnr = log.last("heldout_psnr")
    print(f"done: {log.seconds:.1f} s, {log.rays_per_second():,.0f} training rays/s"
          + (f", held-out PSNR {psnr:.2f} dB" if psnr is not None else "") + f"; run folder {run.folder}")
    print(f"time: {run.phases.summary()}")
    if appearance is not None:
        _print_time_to_renderable(run, appearance)
    return 0


#: Phases of a fit that a renderable model does not wait for: a first run's compile, and the reference views
#: (rendered and written) that only the held-out score and the fine-tune read.
NOT_TO_RENDERABLE = ("compile", "reference views", "reference views written")


def _print_time_to_renderable(run, appearance) -> None:
    """``fit --appearance pretrained``: the wall clock from the study to the saved renderable model, phase by
    phase (the held-out score's own renders are no phase: they come after the model is made)."""
    phases = [phase for phase in run.phases.phases if phase.name not in NOT_TO_RENDERABLE]
    steps = int(run.log.last("fine_tune_steps") or 0)
    trained = (f"{steps} fine-tune step{'' if steps == 1 else 's'}" if appearance.fine_tunes
               else "no appearance training")
    breakdown = " · ".join(phase.describe(digits=2) for phase in phases)
    log = run.log
    fitted = max((row["step"] for row in log.rows if row.get("stage") == 1), default=0)
    first = log.sdf_first_step_seconds
    geometry = (f"; the SDF fit {fitted} steps of {log.memory.get('sdf_points', 0):,} points"
                + (f", the first {first:.2f} s" if first is not None else "")) if fitted else ""
    wall = sum(phase.seconds for phase in phases if phase.beside is None)  # a phase beside another is in its time
    print(f"study to renderable model: {wall:.2f} s (kernels compiled; "
          f"pretrained appearance, {trained}): {breakdown}{geometry}")


def _pretrained_appearance(args: argparse.Namespace):
    """``fit --appearance pretrained``'s weights, read and checked before the device opens (None for the
    per-study appearance network); the options the Gaussians do not take are refused here too."""
    if args.appearance == "pretrained" and args.representation == "gaussians":
        raise ValueError("--appearance pretrained is for the field (--representation field); the Gaussians carry "
                         "their own colours: leave one of them out")
    if args.shadows and args.representation == "gaussians":
        raise ValueError("--shadows is not available with --representation gaussians yet; leave one of them out")
    if args.appearance != "pretrained":
        if args.weights is not None or args.fine_tune or args.fine_tune_seconds:
            raise ValueError("--weights, --fine-tune and --fine-tune-seconds are for --appearance pretrained; leave "
                             "them out or add that option")
        return None
    if args.shadows:
        raise ValueError("--shadows is not available with --appearance pretrained yet; leave one of them out")
    from ..appearance.latent_scene import PretrainedAppearance
    from ..appearance.pretrain import SHIPPED_WEIGHTS

    return PretrainedAppearance.read(SHIPPED_WEIGHTS if args.weights is None else args.weights, args.fine_tune,
                                     args.fine_tune_seconds)


def cmd_standby(args: argparse.Namespace) -> int:
    """A ``fit`` worker made ready before its study is known, then one job from standard input (app/standby.py)."""
    return serve(_device(args), args.preset, args.warm, main)


def cmd_pretrain(args: argparse.Namespace) -> int:
    """The pretrained appearance's encoder and decoder, fitted across a generated cohort, into a weights file."""
    from ..appearance.pretrain import PretrainConfig, pretrain, write_weights

    out = Path(args.out).expanduser()
    if out.is_dir() or (out.exists() and not args.overwrite):
        raise ValueError(f"{out} exists; give another --out, or --overwrite to replace a weights file")
    if not out.parent.is_dir():
        raise ValueError(f"{out.parent} is not a folder; create it or give another --out")
    config = PretrainConfig(studies=args.studies, seed=args.seed, steps=args.steps, batch=args.batch,
                            max_voxels=args.max_voxels).check()
    gpu = _device(args)
    with tempfile.TemporaryDirectory(prefix="neuralraycast-cohort-") as work:
        result = pretrain(gpu, config, ConsoleProgress(f"pretrain {gpu.backend}"), Path(work))
    written = write_weights(out, result)
    print(f"done: {config.studies} studies, {config.steps} steps, final loss {result.losses[-1]:.5f}; "
          f"weights {written} ({written.stat().st_size:,} bytes)")
    return 0


def _fit_gaussians(gpu, args: argparse.Namespace, settings) -> int:
    """``fit --representation gaussians``: the Gaussian branch into a run folder of its own kind."""
    from ..gaussians.run import fit_gaussians
    from ..progress import CancelOnInterrupt
    from .worker import JsonLines, StopOnStdin

    # The worker's stream (the Slicer module trains through it) as the field's: progress, stop on stdin, done.
    stream = JsonLines() if args.progress_json else None
    stdin_stop = StopOnStdin() if args.progress_json else None
    with CancelOnInterrupt() as cancel:
        should_stop = cancel if stdin_stop is None else (lambda: cancel() or stdin_stop())
        run = fit_gaussians(gpu, args.study, args.out, settings,
                            stream or ConsoleProgress(f"fit gaussians {gpu.backend}"), should_stop,
                            overwrite=args.overwrite)
    log = run.log
    if stream is not None:
        stream.write({"event": "done", "run_folder": str(run.folder), "cancelled": bool(log.cancelled),
                      "seconds": log.seconds, "heldout_psnr": log.scores[-1][1] if log.scores else None})
    if log.cancelled:
        raise Cancelled(f"cancelled after {log.seconds:.1f} s of training; the state reached is saved in {run.folder}")
    psnr = f", held-out PSNR {log.scores[-1][1]:.2f} dB" if log.scores else ""
    print(f"done: {log.seconds:.1f} s, {log.steps} steps, {run.scene.count:,} Gaussians{psnr}; run folder {run.folder}")
    return 0


def _is_gaussian_run(folder: str) -> bool:
    from ..gaussians.run import is_gaussian_run

    return is_gaussian_run(folder)


def _refuse_gaussian_run(folder: str, what: str) -> None:
    """A command the Gaussian branch does not offer yet: one line saying so, before any work."""
    if _is_gaussian_run(folder):
        raise ValueError(f"{folder} is a Gaussian run ({what} is for field runs only so far); use 'evaluate' or "
                         "'render' or 'mesh' on it, or fit a field run")


def cmd_cohort(args: argparse.Namespace) -> int:
    """Every study of a list trained into its own folder under --out, here (one after another, or on this
    machine's GPUs without Ray) or on a Ray cluster; resumable."""
    from ..cohort.runner import Cluster, StudiesFailedError, run_cohort
    from ..cohort.study_task import FitOptions
    from ..cohort.tasks import read_task_list

    check_run_values(seed=args.seed, views=args.views, iterations=args.iterations)
    if args.cpus_per_study <= 0:
        raise ValueError(f"--cpus-per-study must be above 0 (got {args.cpus_per_study:g})")
    for option, value, least in (("--gpus", args.gpus, 0) if args.ray_address else
                                 ("--gpus without --ray-address", args.gpus, 1), ("--cpus", args.cpus, 1),
                                 ("--studies-per-gpu", args.studies_per_gpu, 1)):
        if isinstance(value, int) and value < least:
            raise ValueError(f"{option} must be at least {least} (got {value})")
    if args.cpus is not None and args.ray_address is None:
        raise ValueError("--cpus sizes a local Ray cluster: add --ray-address local (without Ray, --gpus N runs "
                         "the studies on this machine's GPUs)")
    tasks = read_task_list(args.list)
    options = FitOptions(preset=args.preset, iterations=args.iterations, views=args.views, size=args.size,
                         max_voxels=args.max_voxels, seed=args.seed, device=args.device, gpu_memory=args.gpu_memory,
                         meshes=tuple(args.meshes or ()), warm_up=not args.no_warmup)
    cluster = Cluster(args.ray_address, args.cpus, args.gpus, args.studies_per_gpu, args.cpus_per_study)
    result = run_cohort(tasks, args.out, options, cluster, lambda line: print(line, flush=True), describe_error)
    if result.failed:
        raise StudiesFailedError(f"{result.failed} of {result.total} studies failed (their errors are in "
                                 f"{Path(args.out) / 'failed'} and {Path(args.out) / 'summary.html'}); run the same "
                                 "command again to retry them (the studies done are skipped)")
    return 0


def _gpu_count(text: str) -> int | str:
    """``--gpus``: a number, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a number of GPUs or auto (got {text!r})") from None


def cmd_render(args: argparse.Namespace) -> int:
    """Orbit views of a trained field, written like the reference views (RGBA, depth and normal pictures,
    contact sheet, cameras.json, reference.npz with the float G-buffer)."""
    from ..render.camera import orbit_cameras
    from ..render.reference_views import ReferenceViews, check_views_folder, save_reference_views
    from ..train.run_folder import open_run

    if args.views < 1:
        raise ValueError(f"views must be at least 1 (got {args.views})")
    check_output(args.out, args.run_folder, overwrite=args.overwrite)
    check_views_folder(args.out)  # before rendering, not after
    if _is_gaussian_run(args.run_folder):
        from ..gaussians.run import open_gaussian_run

        run = open_gaussian_run(_device(args), args.run_folder, ConsoleProgress("prepare"))
    else:
        run = open_run(_device(args), args.run_folder, ConsoleProgress("prepare"))
    progress = ConsoleProgress("render")
    cameras = orbit_cameras(run.prepared.bounds, args.views, args.size[0], args.size[1])
    images = []
    for index, camera in enumerate(cameras):
        progress(f"view {index + 1}/{len(cameras)}", index / len(cameras))
        images.append(run.render(camera))
    progress("done", 1.0)
    folder = save_reference_views(ReferenceViews(cameras, images, list(range(len(cameras))), []), args.out)
    print(f"{len(cameras)} views in {folder}; see {folder / 'contact_sheet.png'}")
    return 0


def cmd_frame_rate(args: argparse.Namespace) -> int:
    """Frames per second of the live view: a trained field rendered from a camera orbiting it, picture by
    picture through the live view's scheduler, each made into the bytes the view shows and read back."""
    from ..render.camera import check_view_size
    from ..render.live_view import time_live_view
    from ..train.run_folder import open_run

    width, height = args.size
    if args.frames < 1:
        raise ValueError(f"frames must be at least 1 (got {args.frames})")
    check_view_size(width, height)  # before the run is opened, not after
    if _is_gaussian_run(args.run_folder):
        from ..gaussians.run import open_gaussian_run

        run = open_gaussian_run(_device(args), args.run_folder, ConsoleProgress("prepare"))
    else:
        run = open_run(_device(args), args.run_folder, ConsoleProgress("prepare"))
    result = time_live_view(run.render_picture, run.prepared.bounds, args.frames, width, height)
    if args.json:
        _print_json(result)
        return 0
    print(f"{result['frames_per_second']:.2f} frames/s at {width} x {height} ({result['ms_per_frame']:.1f} ms a "
          f"frame, {args.frames} frames; the first, timed apart, {result['first_frame_s']:.2f} s)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..train.run_folder import export_run

    _refuse_gaussian_run(args.run_folder, "export")
    source = Path(args.run_folder) / "model.safetensors"
    check_output(args.out, args.run_folder, overwrite=args.overwrite)
    folder = export_run(args.run_folder, args.out, args.precision, overwrite=args.overwrite)
    before, after = source.stat().st_size, (folder / "model.safetensors").stat().st_size
    print(f"{folder}: model {after / 1e6:.1f} MB in {args.precision} (was {before / 1e6:.1f} MB); "
          f"'neuralraycast evaluate {folder}' scores it")
    return 0


def cmd_share(args: argparse.Namespace) -> int:
    """One HTML page that renders the trained field live in a browser (WebGPU), with no network request."""
    from ..train.run_folder import open_run
    from .share import check_page_path, write_page

    _refuse_gaussian_run(args.run_folder, "share")
    out = check_page_path(args.out, args.overwrite)
    run = open_run(_device(args), args.run_folder, ConsoleProgress("prepare"))
    page = write_page(run, out)
    shadows = " (with its meshes' shadows)" if run.renderer.mesh_shadows is not None else ""
    print(f"{page}: {page.stat().st_size / 1e6:.1f} MB; open it in a browser with WebGPU{shadows}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from ..train.evaluate import shown
    from ..train.run_folder import evaluate_run

    gpu = _device(args)
    if _is_gaussian_run(args.run_folder):
        return _evaluate_gaussians(gpu, args)
    metrics = evaluate_run(gpu, args.run_folder, ConsoleProgress("evaluate"))
    if args.json:
        _print_json(metrics)
        return 0
    print(f"held-out PSNR {shown(metrics['heldout_psnr'], '.2f')} dB, SSIM {shown(metrics['heldout_ssim'], '.4f')}")
    print(f"{'structure':18s} {'Dice':>6s} {'mean mm':>8s} {'HD95 mm':>8s} {'label ml':>9s} {'learned ml':>10s} "
          f"{'volume':>7s} {'pieces kept':>11s}")
    for name, dice in metrics["dice"].items():
        mean, hd95 = metrics["mean_surface_distance_mm"][name], metrics["hd95_mm"][name]
        change = metrics["volume_difference_percent"][name]
        kept = f"{metrics['pieces_kept'][name]} of {metrics['label_pieces'][name]}"
        print(f"{name:18s} {dice:6.3f} {shown(mean, '8.2f'):>8s} {shown(hd95, '8.2f'):>8s} "
              f"{metrics['label_volume_ml'][name]:9.2f} {metrics['learned_volume_ml'][name]:10.2f} "
              f"{shown(change, '+6.1f') + '%' if change is not None else '–':>7s} {kept:>11s}")
    exact = {name: (mean, metrics["exact_hd95_mm"][name])
             for name, mean in metrics.get("exact_mean_distance_mm", {}).items() if mean is not None}
    if exact:
        print("to the exact surfaces the labels were drawn from: " + ", ".join(
            f"{name} {mean:.2f} mm (HD95 {hd95:.2f})" for name, (mean, hd95) in exact.items()))
    ceiling = {name: value for name, value in metrics.get("ceiling_dice", {}).items() if value is not None}
    if ceiling:
        print("the exact surfaces themselves against the labels (the most a faithful surface scores):")
        for name, value in ceiling.items():
            print(f"  {name:16s} Dice {value:.3f} (the learned {shown(metrics['dice_of_ceiling'][name], '.3f')} of "
                  f"it), HD95 {shown(metrics['ceiling_hd95_mm'][name], '.2f')} mm, volume "
                  f"{shown(metrics['ceiling_volume_difference_percent'][name], '+.1f')}%")
    left_out = {name: value for name, value in metrics.get("left_out_volume_ml", {}).items() if value}
    if left_out:
        print("label volume without the small pieces left out of the surface: " + ", ".join(
            f"{name} {value:.3f} ml left out" for name, value in left_out.items()))
    for name, dropped in metrics["pieces_dropped"].items():
        for piece in dropped:
            print(f"{name}: a piece of {piece['voxels']} voxels ({piece['volume_ml']:.3f} ml) at RAS "
                  f"{piece['centre_ras']} mm is not in the learned surface")
    print(f"written to {Path(args.run_folder) / 'metrics.json'}")
    return 0


def _evaluate_gaussians(gpu, args: argparse.Namespace) -> int:
    from ..gaussians.run import evaluate_gaussian_run
    from ..train.evaluate import shown

    metrics = evaluate_gaussian_run(gpu, args.run_folder, ConsoleProgress("evaluate"))
    if args.json:
        _print_json(metrics)
        return 0
    print(f"held-out PSNR {metrics['heldout_psnr']:.2f} dB, SSIM {metrics['heldout_ssim']:.4f}; "
          f"{metrics['gaussians']:,} Gaussians, model {metrics['model_bytes'] / 1e6:.1f} MB")
    print(f"{'structure':18s} {'Dice':>6s} {'mean mm':>8s} {'HD95 mm':>8s} {'label ml':>9s} {'learned ml':>10s}")
    for name, dice in metrics["dice"].items():
        print(f"{name:18s} {dice:6.3f} {shown(metrics['mean_surface_distance_mm'][name], '8.2f'):>8s} "
              f"{shown(metrics['hd95_mm'][name], '8.2f'):>8s} {metrics['label_volume_ml'][name]:9.2f} "
              f"{metrics['learned_volume_ml'][name]:10.2f}")
    print(f"written to {Path(args.run_folder) / 'metrics.json'}")
    return 0


def cmd_mesh(args: argparse.Namespace) -> int:
    from ..mesh.mesh import mesh_prepared, write_meshes

    check_output(args.out, args.study, overwrite=args.overwrite)
    if _is_gaussian_run(args.study):  # the Gaussians' structure weights
        from ..gaussians.run import open_gaussian_run

        run = open_gaussian_run(_device(args), args.study, ConsoleProgress("prepare"))
        meshes = run.meshes(args.smooth, args.decimate)
    elif (Path(args.study) / "run.json").exists():  # a run folder: the learned surfaces
        from ..train.run_folder import open_run

        run = open_run(_device(args), args.study, ConsoleProgress("prepare"))
        meshes = run.meshes(args.smooth, args.decimate)
    else:  # a study: its boundary maps (the classic route)
        meshes = mesh_prepared(_prepare(args.study, use_cache=True), args.smooth, args.decimate)
    paths = write_meshes(meshes, args.out, args.formats)
    for mesh in meshes:
        print(f"{mesh.name:16s} {len(mesh.faces):8d} triangles")
    print(f"{len(paths)} files in {args.out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench.suites import run_bench
    from ..study.preprocess import prepare
    from ..study.sample import cached_sample
    from ..study.study import load_study

    gpu = _device(args)
    manifest = cached_sample(args.case, args.spacing, progress=ConsoleProgress(f"sample {args.case}"))
    prepared = prepare(load_study(manifest), progress=ConsoleProgress("prepare"))
    study = f"{args.case} sample, {' x '.join(map(str, prepared.study.shape))} voxels"
    command = "neuralraycast " + " ".join(sys.argv[1:]) if args.command_line is None else args.command_line
    report = run_bench(gpu, prepared, study, args.suite, args.quick, command, ConsoleProgress("bench"))
    if args.json:
        _print_json(report.as_dict())
    else:
        print(report.markdown())
    if args.append:
        with open(args.append, "a") as handle:
            handle.write("\n" + report.markdown())
        print(f"appended to {args.append}", file=sys.stderr)
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    """Compile the kernels the demo and 'fit' use on this machine, so later runs start at once."""
    from ..gpu.device import STRUCTURE_SLOTS
    from ..study.sample import cached_sample
    from ..train.presets import RunSettings
    from ..train.warmup import default_jobs, warm_up

    gpu = open_device(args.device)
    settings = RunSettings.for_device(gpu, args.preset)
    study = args.study or cached_sample("icbm", progress=ConsoleProgress("sample icbm"))
    jobs = args.jobs or default_jobs(gpu)
    seconds = warm_up(gpu, study, settings, ConsoleProgress(f"warm-up ({settings.preset}, {jobs} at once)"),
                      jobs=jobs, structure_slots=STRUCTURE_SLOTS if args.all_capacities else ())
    for phase, value in seconds.items():
        print(f"{phase:45s} {value:7.1f} s")
    print(f"shader cache: {gpu.report.shader_cache}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on the built-in sample case: train, render, mesh, evaluate, report."""
    from .demo import run_demo

    report = run_demo(args.out, args.device, args.case, args.spacing, args.seed, args.preset,
                      warm_up_first=not args.no_warmup, overwrite=args.overwrite, gpu_memory=args.gpu_memory,
                      branches=args.branches)
    print(f"\nreport: {report}")
    return 0


def _megabytes(count: int) -> str:
    return f"{count / 1e6:,.1f} MB"


def cmd_cache(args: argparse.Namespace) -> int:
    """List the cache's folders (what each keeps, entries, size), or clear some of them."""
    from ..paths import CACHE_ENV, cache_dir, cache_folder, clear_cache, folder_bytes

    if args.clear:
        names = list(CACHE_FOLDERS) if "all" in args.clear else list(dict.fromkeys(args.clear))
        freed = clear_cache(names)
        if args.json:
            _print_json({"cleared": names, "freed_bytes": freed})
        else:
            print(f"cleared {', '.join(names)} in {cache_dir()}: {_megabytes(freed)} freed")
        return 0
    folders = []
    for name, holds in CACHE_FOLDERS.items():
        size, entries = folder_bytes(cache_folder(name))
        folders.append({"name": name, "path": str(cache_folder(name)), "bytes": size, "entries": entries,
                        "holds": holds})
    total = sum(f["bytes"] for f in folders)
    if args.json:
        _print_json({"cache": str(cache_dir()), "folders": folders, "total_bytes": total})
        return 0
    print(f"cache {cache_dir()} (${CACHE_ENV} moves it)")
    for f in folders:
        noun = "entry" if f["entries"] == 1 else "entries"
        print(f"  {f['name']:<10}{_megabytes(f['bytes']):>12}  {f['entries']:>3} {noun:<7}  {f['holds']}")
    print(f"  {'total':<10}{_megabytes(total):>12}")
    print("clear with: neuralraycast cache --clear NAME ... (or all)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neuralraycast",
        description="Neural intrinsic fields for brain MRI, trained through a differentiable Slang raycaster.",
        epilog=EXIT_STATUSES,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details (and tracebacks) to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def device_option(p: argparse.ArgumentParser, memory: bool = True) -> None:
        p.add_argument("--device", choices=CHOICES, default=None,
                       help=f"GPU backend (default: ${DEVICE_ENV} or auto = CUDA, else Vulkan; on macOS Metal, "
                            "else Vulkan)")
        if memory:
            p.add_argument("--gpu-memory", metavar="AMOUNT", default=None,
                           help=f"GPU memory the work may take, e.g. 6G, 6GiB or 6000M (binary units); batches, "
                                f"bands and the study's grid are sized to it (default: ${GPU_MEMORY_ENV}, else the "
                                "GPU's free memory less a margin; docs/gpu-memory.md)")

    def preset_option(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--preset", choices=[AUTO, *PRESETS], default=None, help=f"{what}: {presets_help()}")

    def overwrite_option(p: argparse.ArgumentParser, what: str = "writing over files of the same names") -> None:
        p.add_argument("--overwrite", action="store_true", help=f"accept a non-empty output folder, {what}")

    def warmup_option(p: argparse.ArgumentParser) -> None:
        p.add_argument("--no-warmup", action="store_true",
                       help="on a GPU whose kernels this machine has not compiled yet, compile them in the run "
                            "itself (much slower) instead of running 'neuralraycast warmup' first")

    def pieces_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--min-piece-ml", type=_millilitres, default=MIN_PIECE_ML, metavar="ML",
                       help="pieces and holes of a label smaller than this are left out of its surface and listed "
                            f"(default {MIN_PIECE_ML:g}; 0 keeps every piece)")
        p.add_argument("--keep-small-pieces", action="store_true",
                       help="keep those pieces as small surfaces of their own instead of leaving them out")

    p = sub.add_parser("info", help="show the GPU device, its features, versions, the shader cache and whether the "
                       "networks run on tensor cores there")
    device_option(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_info)

    p = sub.add_parser("cache", help="list the cache's folders and their sizes, or clear some of them")
    p.add_argument("--clear", nargs="+", metavar="NAME", choices=[*CACHE_FOLDERS, "all"],
                   help=f"remove these folders ({', '.join(CACHE_FOLDERS)}, or all); each is filled again "
                        "when needed")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_cache)

    p = sub.add_parser("sample", help="write a sample study (BraTS names + manifest.json) into FOLDER")
    p.add_argument("folder", help="output folder")
    p.add_argument("--case", choices=CASES, default="icbm",
                   help="icbm: real anatomy + synthetic lesion (default); phantom: analytic; fixture: tiny real T1")
    p.add_argument("--spacing", type=_spacing, default=None,
                   help="voxel size in mm, or three for i, j, k (the phantom: thick slices such as 1,1,5) "
                        "(default: the case's own)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the synthetic lesion and noise")
    p.add_argument("--labels", choices=list(LABEL_STYLES), default="clean",
                   help="how the labels are drawn: clean (the exact voxelisation), ragged (slice-wise jitter, "
                        "specks, holes, skipped and doubled slices, partial-volume rims, as people draw them), "
                        "thick (ragged, drawn on 5 mm slices)")
    p.set_defaults(run=cmd_sample)

    p = sub.add_parser("prepare", help="check a study and derive boundary maps, P(x) and occupancy")
    p.add_argument("study", help="study folder (BraTS names or manifest.json) or a manifest.json")
    p.add_argument("--no-cache", action="store_true", help="recompute even if cached")
    p.add_argument("--preview", metavar="PNG", help="also save a slice preview with structure contours")
    p.add_argument("--json", action="store_true", help="print JSON")
    pieces_options(p)
    p.set_defaults(run=cmd_prepare)

    p = sub.add_parser("render-reference", help="render reference views of a study (PNG, depth, normals, cameras)")
    device_option(p)
    p.add_argument("study", help="study folder or manifest.json")
    p.add_argument("--views", type=int, default=24, help="number of orbit views (default 24)")
    p.add_argument("--size", type=int, nargs=2, default=(256, 256), metavar=("W", "H"), help="image size")
    p.add_argument("--shadows", action="store_true", help="volumetric shadows of the key light (slower)")
    p.add_argument("--view-angle", type=float, default=30.0, help="vertical field of view in degrees")
    p.add_argument("--held-out-every", type=int, default=8, help="hold out every N-th view for evaluation")
    p.add_argument("--out", required=True, help="output folder")
    overwrite_option(p)
    p.set_defaults(run=cmd_render_reference)

    p = sub.add_parser("fit", help="train a neural field on a study (geometry, appearance, joint) into a run folder")
    device_option(p)
    p.add_argument("study", help="study folder or manifest.json")
    p.add_argument("--out", required=True, help="run folder (model.safetensors, train_log.json, reference/); "
                   "a run of the same study there is replaced")
    overwrite_option(p, "replacing a run there (of any study) and writing beside other files")
    preset_option(p, "training preset")
    p.add_argument("--iterations", type=int, default=None,
                   help="optimisation steps of all stages together (default: the preset's)")
    p.add_argument("--views", type=int, default=None, help="reference views (default: the preset's)")
    p.add_argument("--size", type=int, default=None, help="view size in pixels (default: the preset's)")
    p.add_argument("--max-voxels", type=int, default=None, metavar="N",
                   help="downsample the study so that no axis has more than N voxels (default: the preset's, or "
                        "what the GPU memory budget holds)")
    p.add_argument("--seed", type=int, default=0, help="random seed (initialisation, batches)")
    p.add_argument("--representation", choices=["field", "gaussians"], default="field",
                   help="what to train: the neural field (signed distances and appearance; default) or ray-traced "
                        "anisotropic Gaussians (gaussians.safetensors; evaluate, render and mesh take its runs)")
    p.add_argument("--shadows", action="store_true",
                   help="reference views with key-light shadows; the field is shaded through meshes of its own "
                        "surfaces, re-extracted as it trains, so shadows are not learned as colour")
    p.add_argument("--appearance", choices=("network", "pretrained"), default="network",
                   help="network (default): the per-study appearance network, trained through the renderer; "
                        "pretrained: the encoder of --weights over the study into a latent grid, no appearance "
                        "training")
    p.add_argument("--weights", default=None, metavar="FILE",
                   help="pretrained appearance weights for --appearance pretrained ('neuralraycast pretrain'; "
                        "default: the weights the package ships)")
    p.add_argument("--fine-tune", type=int, default=0, metavar="STEPS",
                   help="with --appearance pretrained: image steps on the latent grid and the decoder after the "
                        "encoder (default 0: none; with --fine-tune-seconds, at most this many)")
    p.add_argument("--fine-tune-seconds", type=float, default=0.0, metavar="S",
                   help="with --appearance pretrained: fine-tune for this many seconds of wall clock (with "
                        "--fine-tune, whichever ends first; default 0: no time limit)")
    pieces_options(p)
    warmup_option(p)
    p.add_argument("--progress-json", action="store_true",
                   help="for a program that runs 'fit' as a worker: progress as one JSON object a line on standard "
                        "output (stage, fraction, loss, held-out PSNR; then done or error), and a line 'stop' on "
                        "standard input, or its closing, stops training keeping the state reached")
    p.set_defaults(run=cmd_fit)

    p = sub.add_parser("standby", help="for a program that starts 'fit' workers: a worker made ready before its "
                       "study is known (backend imported, device open, the kernels of the pretrained route and of "
                       "the network's stages called once on a phantom), which then runs one fit job read from "
                       "standard input and ends")
    device_option(p)
    preset_option(p, "the preset whose kernels are called ahead")
    p.add_argument("--warm", choices=WARM_CHOICES, default="auto",
                   help="call the kernels ahead: auto (default) on a GPU whose kernels are compiled, yes anywhere, "
                        "no never")
    p.set_defaults(run=cmd_standby, progress_json=True)

    p = sub.add_parser("pretrain", help="fit the pretrained appearance's encoder and decoder across generated "
                       "studies (the phantom, then ICBM152 samples on seeds never used for evaluation)")
    device_option(p)
    p.add_argument("--out", required=True, help="weights file to write (safetensors)")
    p.add_argument("--overwrite", action="store_true", help="replace a weights file there")
    p.add_argument("--studies", type=int, default=4, help="studies of the cohort, the phantom first (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the cohort's studies, the points and the weights")
    p.add_argument("--steps", type=int, default=600, help="optimisation steps (default 600)")
    p.add_argument("--batch", type=int, default=4096, help="points a step (default 4096)")
    p.add_argument("--max-voxels", type=int, default=96, metavar="N",
                   help="downsample each study so no axis has more than N voxels (default 96)")
    p.set_defaults(run=cmd_pretrain)

    p = sub.add_parser("cohort", help="train every study of a list into its own run folder under --out, on this "
                       "machine or a Ray cluster; run it again to finish an interrupted cohort")
    device_option(p)
    p.add_argument("list", metavar="LIST", help="a folder of study folders, a CSV or JSON list of study paths "
                   "(or of generated studies: a 'case' column), or a quoted glob pattern (docs/cohorts.md)")
    p.add_argument("--out", required=True, help="cohort folder: studies/<name>/ per study done, failed/<name>/ per "
                   "study that failed, summary.csv, summary.json, summary.html")
    preset_option(p, "training preset")
    p.add_argument("--iterations", type=int, default=None, help="optimisation steps per study (default: the preset's)")
    p.add_argument("--views", type=int, default=None, help="reference views (default: the preset's)")
    p.add_argument("--size", type=int, default=None, help="view size in pixels (default: the preset's)")
    p.add_argument("--max-voxels", type=int, default=None, metavar="N", help="downsample each study to at most N "
                   "voxels a side (default: the preset's, or what the GPU memory budget holds)")
    p.add_argument("--seed", type=int, default=0, help="random seed of every study's run")
    p.add_argument("--meshes", nargs="+", choices=["vtp", "stl", "obj", "ply"], default=None, metavar="FORMAT",
                   help="also write the learned surfaces' meshes into each study's meshes/ (vtp, stl, obj, ply)")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="run the studies as Ray tasks: auto or ray://host:port (an existing cluster; every node "
                        "needs neuralraycast and the same paths), or local (a cluster on this machine); default: "
                        "on this machine without Ray (see --gpus). Needs: pip install 'neuralraycast[cohort]'")
    p.add_argument("--gpus", type=_gpu_count, default=None, metavar="N|auto",
                   help="without --ray-address: train on N GPUs of this machine (auto: all that nvidia-smi lists), "
                        "a process per study, --studies-per-gpu of them on each GPU at once; no Ray needed. "
                        "Without --gpus, the studies run one after another in this process. With --ray-address "
                        "local: the GPUs of that Ray cluster")
    p.add_argument("--cpus", type=int, default=None, metavar="N",
                   help="CPUs of a local Ray cluster (with --ray-address local)")
    p.add_argument("--studies-per-gpu", type=int, default=None, metavar="N",
                   help="studies sharing a GPU at once (default: as many as --gpu-memory, each study's budget, "
                        "leaves room for; one without it)")
    p.add_argument("--cpus-per-study", type=float, default=1.0, metavar="N",
                   help="CPUs each study's task asks Ray for (default 1; on a cluster without GPUs, where a study "
                        "trains on a software device that uses every core it finds, give all of a node's)")
    warmup_option(p)
    p.set_defaults(run=cmd_cohort)

    p = sub.add_parser("evaluate", help="score a run: held-out PSNR/SSIM, Dice and surface distances per structure")
    device_option(p)
    p.add_argument("run_folder", metavar="RUN", help="run folder written by 'fit'")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_evaluate)

    p = sub.add_parser("export", help="copy a run folder with its model stored in float16 (half the size)")
    p.add_argument("run_folder", metavar="RUN", help="run folder written by 'fit'")
    p.add_argument("--out", required=True, help="new run folder to write")
    overwrite_option(p, "replacing a run folder there once the copy is complete")
    p.add_argument("--precision", choices=["float16", "float32"], default="float16",
                   help="how the parameters are stored (default float16)")
    p.set_defaults(run=cmd_export)

    p = sub.add_parser("share", help="write one HTML page that renders a trained field live in a web browser "
                                     "(WebGPU; no network requests, no patient identifiers)")
    device_option(p)
    p.add_argument("run_folder", metavar="RUN", help="run folder written by 'fit'")
    p.add_argument("--out", required=True, help="the page to write (.html)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing page of that name")
    p.set_defaults(run=cmd_share)

    p = sub.add_parser("render", help="render orbit views of a trained field (RGBA, depth, normals)")
    device_option(p)
    p.add_argument("run_folder", metavar="RUN", help="run folder written by 'fit'")
    p.add_argument("--out", required=True, help="output folder")
    overwrite_option(p)
    p.add_argument("--views", type=int, default=8, help="number of orbit views (default 8)")
    p.add_argument("--size", type=int, nargs=2, default=[512, 512], metavar=("W", "H"), help="pixels (512 512)")
    p.set_defaults(run=cmd_render)

    p = sub.add_parser("frame-rate", help="frames per second of the live view: a trained field rendered from an "
                                          "orbiting camera, as the Slicer module's live view renders it")
    device_option(p)
    p.add_argument("run_folder", metavar="RUN", help="run folder written by 'fit'")
    p.add_argument("--frames", type=int, default=60, help="frames to time after the first (default 60)")
    p.add_argument("--size", type=int, nargs=2, default=[1024, 1024], metavar=("W", "H"),
                   help="pixels (1024 1024)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_frame_rate)

    p = sub.add_parser("mesh", help="triangle meshes (marching cubes, RAS mm): a run's learned surfaces or a "
                                    "study's segmentation")
    device_option(p)
    p.add_argument("study", help="run folder written by 'fit' (learned surfaces; a Gaussian run's from its structure "
                   "weights), or study folder / manifest.json")
    p.add_argument("--out", required=True, help="output folder")
    overwrite_option(p)
    p.add_argument("--formats", nargs="+", default=["vtp"], choices=["vtp", "stl", "obj", "ply"],
                   help="file formats (default vtp)")
    p.add_argument("--smooth", type=int, default=0, metavar="N", help="windowed-sinc smoothing iterations")
    p.add_argument("--decimate", type=float, default=0.0, metavar="F", help="fraction of triangles to remove")
    p.set_defaults(run=cmd_mesh)

    if HAS_BENCH:  # the measurement code is in a clone, not in the Slicer extension
        p = sub.add_parser("bench", help="measure speed on this device (Markdown for BENCHMARKS.md)")
        device_option(p)
        p.add_argument("--suite", nargs="+", default=["reference"],
                       help="suites to run: reference, sdf_fit, train, mesh_accuracy, torch_peer (the same SDF fit in "
                            "PyTorch, eager and compiled; needs PyTorch), startup (how long a second run waits before "
                            "it trains), prepare (the study prepared afresh on the CPU), workstation (fit from the "
                            "study folder to the saved run, by phase, with its peak GPU memory, under the device's, an "
                            "8 GiB and a 4 GiB budget; clears the cached boundary maps and views), branches (the "
                            "field and the Gaussians trained on the same views, side by side: PSNR, SSIM, training "
                            "time, frame times, GPU memory, model bytes, Dice and surface distances), kernels "
                            "(registers, spills and shared memory of the CUDA kernels compiled so far, by ptxas: "
                            "list it last) (default: reference)")
        p.add_argument("--case", choices=CASES, default="icbm", help="sample case to measure on (default icbm)")
        p.add_argument("--spacing", type=float, default=None, help="voxel size in mm (default: the case's own)")
        p.add_argument("--quick", action="store_true",
                       help="for slow devices: fewer repetitions, smaller batches and frames (no 1024² frames)")
        p.add_argument("--append", metavar="MD", help="append the Markdown section to this file")
        p.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
        p.add_argument("--command-line", default=None, help=argparse.SUPPRESS)
        p.set_defaults(run=cmd_bench)

    p = sub.add_parser("warmup", help="compile the kernels of the demo and 'fit' ahead (kept in the shader cache)")
    device_option(p, memory=False)
    p.add_argument("study", nargs="?", default=None, help="study to warm up for (default: the icbm sample)")
    preset_option(p, "preset to warm up for")
    p.add_argument("--all-capacities", action="store_true",
                   help="also compile the kernels for the other number of structures (the kernels hold 1 to 4 "
                        "or 5 to 8 structures and up to 4 channels; the study's own serve every study that fits "
                        "them), so that a study with any number of structures compiles nothing")
    p.add_argument("--jobs", type=int, default=0,
                   help="compile the kernels in this many processes at once (default: up to four on a GPU "
                        "machine, the SDF fit, the forward passes and the joint backward's two passes side by "
                        "side; one on a software device)")
    p.set_defaults(run=cmd_warmup)

    p = sub.add_parser("demo", help="the main job on the built-in sample case: train, render, mesh, report.html")
    device_option(p)
    preset_option(p, "training preset")
    p.add_argument("--out", default="demo-output", help="output folder (default: demo-output)")
    overwrite_option(p, "writing over an earlier demo's files")
    p.add_argument("--case", choices=CASES, default="icbm", help="sample case (default: icbm)")
    p.add_argument("--spacing", type=float, default=None, help="voxel size in mm (default: the case's own)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--branches", nargs="+", default=["field"], metavar="BRANCH",
                   help="representations to train: field (always), and gaussians to train the anisotropic Gaussians "
                        "on the same views too, the report showing a column per branch (default: field)")
    warmup_option(p)
    p.set_defaults(run=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        if getattr(args, "gpu_memory", None) is not None:
            parse_memory(args.gpu_memory)  # a bad amount is refused before any work
        if not (getattr(args, "json", False) or getattr(args, "progress_json", False)):
            return args.run(args)
        with _native_output_to_stderr():
            return args.run(args)
    except Cancelled as error:
        print(f"neuralraycast {args.command}: {one_line(str(error))}", file=sys.stderr)
        return EXIT_CANCELLED
    except USER_ERRORS as error:
        if args.verbose:
            logging.exception("failed")
        message = describe_error(error)
        if isinstance(error, GpuMemoryError) and "--gpu-memory" not in message:
            message = f"{message}; {LOWER}"
        print(f"neuralraycast {args.command}: error: {message}", file=sys.stderr)
        if getattr(args, "progress_json", False):
            print(strict_json.dumps({"event": "error", "message": message}), flush=True)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"neuralraycast {args.command}: cancelled", file=sys.stderr)
        return EXIT_CANCELLED


if __name__ == "__main__":
    sys.exit(main())
