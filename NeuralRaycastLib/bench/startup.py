"""How long a run waits before it trains: the milestones of ``neuralraycast fit``'s start, timed in a fresh
process (what a user starting a second run waits for, with the shader and study caches warm).

``python -m NeuralRaycastLib.bench.startup STUDY SPAWNED [--preset P] [--device D]`` goes through a run's start
(imports, device, study, reference views, field and trainer, one SDF-fit step, one joint step) and prints
one JSON object: seconds since ``SPAWNED`` (the parent's ``time.time()`` just before it started this
process) at each milestone. ``bench --suite startup`` runs it twice and reports the second run, then
times the same start twice in its own process (:func:`start_in_process`: a second run in Slicer, where the
device stays open and the kernels stay loaded).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the imports themselves are what the probe times)
    from ..gpu.device import GpuContext
    from ..train.presets import RunSettings

MILESTONES = (
    "imports",
    "device open",
    "study prepared",
    "reference views",
    "field and trainer",
    "first SDF-fit step",
    "first joint step",
)


def run_start(study: str, spawned: float, preset_name: str | None = None, device: str | None = None) -> dict:
    """Go through a run's start as ``fit`` does; seconds since ``spawned`` at each milestone."""
    times: dict[str, float] = {}

    def mark(name: str) -> None:
        times[name] = time.time() - spawned

    from ..gpu.device import open_device
    from ..train.presets import RunSettings

    _import_training()
    mark("imports")
    gpu = open_device(device)
    mark("device open")
    settings = RunSettings.for_device(gpu, preset_name)
    _start_training(gpu, study, settings, mark)
    return {"preset": settings.preset, "views": settings.views, "size": settings.size, "seconds": times}


def start_in_process(gpu: GpuContext, study: str | Path, preset_name: str | None = None) -> dict[str, float]:
    """The same start in a process that already has the device open (a second run in Slicer or in a Python
    session, where the kernels are loaded too once a first run has started): seconds at each milestone
    after the imports and the device."""
    from ..train.presets import RunSettings

    start = time.perf_counter()
    times: dict[str, float] = {}
    _start_training(gpu, study, RunSettings.for_device(gpu, preset_name),
                    lambda name: times.__setitem__(name, time.perf_counter() - start))
    return times


def _import_training() -> None:
    from ..field import field, sdf_fit  # noqa: F401
    from ..render import reference_views  # noqa: F401
    from ..train import run_folder, trainer  # noqa: F401


def _start_training(gpu: GpuContext, study: str | Path, settings: RunSettings, mark: Callable[[str], None]) -> None:
    """Study, reference views, field and trainer, one SDF-fit step and one joint step, as ``fit`` starts."""
    from ..field.field import NeuralField
    from ..field.sdf_fit import SdfFitter
    from ..render.reference_views import save_reference_views
    from ..train.run_folder import prepare_for_run, reference_views_for_run
    from ..train.trainer import Trainer

    prepared = prepare_for_run(study, settings)
    mark("study prepared")
    views = reference_views_for_run(gpu, prepared, settings)
    mark("reference views")
    # fit writes the view pictures while it trains; so does this probe, into a folder it then removes
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(1) as writer:
        saved = writer.submit(save_reference_views, views, Path(folder) / "reference", arrays=False)
        field = NeuralField(gpu, settings.field_layout(gpu, prepared), seed=settings.seed)
        config = settings.schedule()
        trainer = Trainer(gpu, prepared, field, views, config)
        mark("field and trainer")
        SdfFitter(gpu, prepared, field, config.geometry).step()
        gpu.device.wait()
        mark("first SDF-fit step")
        adam, sdf = trainer.render_optimisers(1)
        trainer.render_step(0, True, adam, sdf)
        gpu.device.wait()
        mark("first joint step")
        saved.result()


def timed_start(study: str | Path, preset_name: str | None = None, device: str | None = None) -> dict:
    """:func:`run_start` in a new Python process (so imports and device creation count)."""
    command = [sys.executable, "-m", __name__, str(study), repr(time.time())]
    command += ["--preset", preset_name] if preset_name else []
    command += ["--device", device] if device else []
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the start-up probe failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study")
    parser.add_argument("spawned", type=float)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    print(json.dumps(run_start(args.study, args.spawned, args.preset, args.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
