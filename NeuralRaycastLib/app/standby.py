"""A training process made ready before its study is known (``neuralraycast standby``): it imports the backend,
opens the device and, on a GPU whose kernels a warm-up has compiled, runs the pretrained route and a step of each of
the per-study network's stages on a small phantom, so that slangpy has built the data of each kernel's call (it
does so on a process's first call of each, which is most of what a fresh process adds to the route's seconds:
BENCHMARKS.md). Then it writes ``{"event": "ready", ...}`` and waits for one job on standard input: a line
``{"fit": [ARGUMENTS]}`` holding the arguments of ``neuralraycast fit`` (the study first). It runs that job as a
fresh ``fit --progress-json`` would, streaming its progress, taking ``stop`` lines and ending the same way, and then
ends itself: one job a process, so a GPU fault still ends that job's process only. Standard input closing before a
job ends it, writing nothing.

The Slicer module keeps one ready beside Slicer, so that Train starts from a warm process."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

#: The event a standby process writes once it waits for its job.
READY = "ready"
#: What ``--warm`` may say: ``auto`` makes the first calls on the phantom on a GPU whose kernels are compiled (on a
#: software device a fit takes minutes: its first calls do not count there), ``yes`` wherever the device is,
#: ``no`` never.
WARM_CHOICES = ("auto", "yes", "no")
#: The phantom the first calls are made on: coarse, so its boundary maps and views take little.
PHANTOM_SPACING_MM = 4.0
#: The route's SDF steps there: a few, as each kernel's data is built on its first call whatever the count.
WARM_ITERATIONS = 2
#: The per-study network's steps there: one of each stage (the SDF fit, appearance, joint).
NETWORK_STEPS = 3


class JobError(ValueError):
    """A job line that is not one ``fit`` job."""


def parse_job(line: str) -> list[str]:
    """The ``fit`` arguments of a job line, with ``--progress-json`` (the job streams as the process does)."""
    try:
        job = json.loads(line)
    except ValueError as error:
        raise JobError(f"the job line is not JSON ({error})") from error
    if not isinstance(job, dict) or set(job) != {"fit"}:
        raise JobError('the job line must be one object {"fit": [arguments of neuralraycast fit]}')
    arguments = job["fit"]
    if not isinstance(arguments, list) or not arguments or not all(isinstance(a, str) for a in arguments):
        raise JobError("the fit job's arguments must be a non-empty list of strings, the study first")
    return ["fit", *arguments, *([] if "--progress-json" in arguments else ["--progress-json"])]


def warm_first_calls(gpu, preset: str | None, warm: str = "auto") -> str:
    """Make the first calls of the pretrained route's kernels and of the per-study network's stages (the maps, the
    field and the SDF fit among them, which every fit shares) in this process: both on a coarse phantom, into a
    folder removed after. Returns what was done, in words (the ready event says it)."""
    from ..appearance.latent_scene import PretrainedAppearance
    from ..appearance.pretrain import SHIPPED_WEIGHTS
    from ..study.sample import cached_sample
    from ..train.presets import RunSettings
    from ..train.run import train_study
    from ..train.run_folder import prepare_for_run
    from ..train.warmup import needs_warm_up

    if warm == "no" or (warm == "auto" and gpu.report.software):
        return "nothing: " + ("asked not to" if warm == "no" else "a software device")
    study = cached_sample("phantom", spacing=PHANTOM_SPACING_MM)
    settings = RunSettings.for_device(gpu, preset, iterations=WARM_ITERATIONS, views=4, size=32)
    folder = Path(tempfile.mkdtemp(prefix="neuralraycast-standby-"))
    try:
        # Kernels not compiled yet would compile here for minutes; the job's own warm-up compiles them faster.
        if warm == "auto" and needs_warm_up(gpu, prepare_for_run(study, settings, gpu=gpu), settings):
            return "nothing: the kernels are not compiled on this machine yet"
        train_study(gpu, study, folder / "route", settings, None, warm_up=False,
                    appearance=PretrainedAppearance.read(SHIPPED_WEIGHTS))
        # A step of each of the per-study network's stages, on the views and maps the route left in the caches.
        train_study(gpu, study, folder / "network", replace(settings, iterations=NETWORK_STEPS), None,
                    warm_up=False)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return f"the pretrained route and the network's stages on the phantom ({settings.preset} preset)"


def serve(gpu, preset: str | None, warm: str, run_job: Callable[[list[str]], int], stdin=None) -> int:
    """``neuralraycast standby`` on an open device: ready, then the one ``fit`` job read from ``stdin`` (default
    standard input) run by ``run_job`` (the command line's ``main``), whose exit code it returns (the module
    docstring)."""
    from .worker import JsonLines

    done = warm_first_calls(gpu, preset, warm)
    JsonLines().write({"event": READY, "backend": gpu.backend, "warmed": done})
    line = (stdin or sys.stdin).readline()
    if not line.strip():  # the starter closed standard input, or went away: no job
        return 0
    return run_job(parse_job(line))
