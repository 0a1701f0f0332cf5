"""Where NeuralRaycast keeps things on disk: the user cache and the Slang shader folder.

One place so the CLI, the Slicer module and the tests agree on every location.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "NEURALRAYCAST_CACHE"
SHADERS_ENV = "NEURALRAYCAST_SHADERS"


def cache_dir() -> Path:
    """The user cache directory (``$NEURALRAYCAST_CACHE``, else ``$XDG_CACHE_HOME/neuralraycast``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or (Path.home() / ".cache")
    return Path(base).expanduser() / "neuralraycast"


def shader_dir() -> Path:
    """The folder holding the project's ``.slang`` files.

    Looked up in this order: ``$NEURALRAYCAST_SHADERS``; ``shaders/`` beside the package (source tree,
    Slicer install); the ``NeuralRaycastLib/shaders`` package data of a pip-installed wheel.
    """
    here = Path(__file__).resolve().parent
    candidates = [Path(os.environ[SHADERS_ENV])] if os.environ.get(SHADERS_ENV) else []
    candidates += [here.parent / "shaders", here / "shaders"]
    for candidate in candidates:
        if (candidate / "device_check.slang").is_file():
            return candidate
    raise FileNotFoundError(
        "NeuralRaycast's Slang shaders were not found (looked in "
        + ", ".join(str(c) for c in candidates)
        + f"); set {SHADERS_ENV} to the project's shaders/ folder"
    )
