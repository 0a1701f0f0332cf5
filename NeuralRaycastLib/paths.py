"""Where NeuralRaycast keeps things on disk: the user cache (its folders, their sizes, clearing them) and the
Slang shader folder.

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


#: Size of the compiled-kernel database (LMDB; its file grows only as entries are written). slangpy's default is
#: 128 MiB, and once an entry does not fit, slangpy 0.43 can neither make room (deleting from a full LMDB map
#: fails: MDB_MAP_FULL) nor store it: every later run compiles that kernel again, minutes for the tensor-core
#: ones. At the default size the render and fit kernels a warm-up compiled were compiled again by the next
#: one, while the small reference-renderer kernels were found (BENCHMARKS.md). gpu.py opens devices with it.
#: slangpy evicts the least recently used entries as the database nears this size.
SHADER_CACHE_BYTES = 2 << 30

#: The cache's folders and what each keeps (``neuralraycast cache`` lists and clears them); all but
#: ``recovered`` are filled again when needed, at the cost given.
CACHE_FOLDERS = {
    "shaders": f"compiled kernels, up to {SHADER_CACHE_BYTES >> 30} GiB per backend (compiled again: minutes)",
    "modules": "Slang's parsed modules, per backend (parsed again: seconds)",
    "studies": "studies as read from their NIfTI files (read again: about a second)",
    "prepared": "boundary maps and what else preparing derives (computed again: seconds to a minute)",
    "views": "the reference views runs train on (rendered again: seconds on a GPU, minutes on a CPU)",
    "samples": "the sample cases as written (written again: seconds)",
    "downloads": "the sample's pinned, checksummed source data (fetched again from the package registry)",
    "logs": "the shader compiler's messages (slangpy.log; only for reading when something goes wrong)",
    "recovered": "trained runs whose run folder could not be written (not made again: move them out first)",
}

#: The folders of data derived from studies (the rest: kernels and the sample's sources).
DATA_CACHE_FOLDERS = ("studies", "prepared", "views")


def cache_folder(name: str) -> Path:
    """One of :data:`CACHE_FOLDERS` in the user cache directory."""
    if name not in CACHE_FOLDERS:
        raise ValueError(f"unknown cache folder '{name}' (known: {', '.join(CACHE_FOLDERS)})")
    return cache_dir() / name


def folder_bytes(folder: Path) -> tuple[int, int]:
    """Bytes of the files under ``folder`` and its entries (the files and folders directly in it)."""
    if not folder.is_dir():
        return 0, 0
    total = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
    return total, sum(1 for _ in folder.iterdir())


def clear_cache(names: list[str]) -> int:
    """Remove the named cache folders (after the entries this process is writing: none lands after); the bytes
    freed."""
    import shutil

    from .array_cache import finish_writes

    finish_writes()
    freed = 0
    for name in names:
        folder = cache_folder(name)
        freed += folder_bytes(folder)[0]
        shutil.rmtree(folder, ignore_errors=True)
    return freed


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


def shader_sources_digest() -> str:
    """A SHA-256 of every ``.slang`` file (names and contents): what compiled kernels and the pictures they
    make depend on, for cache keys that must change when any shader does."""
    import hashlib

    digest = hashlib.sha256()
    for source in sorted(shader_dir().glob("*.slang")):
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()
