"""NeuralRaycast: neural intrinsic fields for brain MRI, trained through a differentiable Slang raycaster.

The backend of the SlicerNeuralRaycast extension. It never imports ``slicer`` or ``qt``; the Slicer
module and the ``neuralraycast`` command line are thin layers over it. The pipeline, one subpackage a step:

    study/   load and check a study; preprocess it (brain mask, boundary maps)
    field/   the neural field, its SDF fit (stage 1), model files
    render/  cameras, the reference raycaster, the differentiable neural renderer
    mesh/    marching cubes, smoothing, mesh files
    train/   presets, the trainer, train_study (the one way to train), run folders, warm-up
    gpu/     the device;  app/  command line, demo, report;  bench/  measurement (not shipped to Slicer)

The names below are importable from here; each loads its module on first use, so ``import
NeuralRaycastLib`` stays cheap (Slicer imports it before the optional packages are installed).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "open_device": "gpu.device",
    "GpuContext": "gpu.device",
    "Study": "study.study",
    "StudyError": "study.study",
    "load_study": "study.study",
    "prepare": "study.preprocess",
    "write_sample": "study.sample",
    "RunSettings": "train.presets",
    "PRESETS": "train.presets",
    "train_study": "train.run",
    "TrainedRun": "train.run_folder",
    "open_run": "train.run_folder",
    "evaluate_run": "train.run_folder",
    "export_run": "train.run_folder",
    "Camera": "render.camera",
    "orbit_cameras": "render.camera",
    "write_meshes": "mesh.mesh",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
