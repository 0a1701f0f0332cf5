"""A study read from its files once: later runs on the same files read its arrays from the cache.

Reading a study means decompressing every NIfTI file; its cached arrays load many times faster. An entry is
named by the study's resolved path and is used only while every file it was read from (the manifest
included) has the size and modification time it had then and the folder lists the same NIfTI files;
otherwise the files are read again and the entry replaced.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from ..array_cache import read_entry, write_entry
from ..paths import cache_folder
from .study import MANIFEST, NIFTI_SUFFIXES, Study, load_study

#: Bump when what an entry holds changes.
STUDY_CACHE_VERSION = 1
#: Studies kept in the cache (the sample at 1 mm takes about 150 MB).
CACHE_ENTRIES = 4
OPTIONAL = ("labels", "probability", "brain_mask")


def load_study_cached(path: str | Path, cache_root: Path | None = None) -> Study:
    """:func:`~NeuralRaycastLib.study.study.load_study`, from the cache when its files have not changed."""
    path = Path(path).expanduser()
    if not path.exists():
        return load_study(path)  # its error names the path
    path = path.resolve()
    entry = (cache_root or cache_folder("studies")) / _entry_name(path)
    cached = read_entry(entry)
    if cached is not None and (study := _from_entry(*cached)) is not None:
        return study
    study = load_study(path)
    manifest = [path / MANIFEST] if (path / MANIFEST).is_file() else []
    read_from = [*manifest, *(Path(source) for source in study.sources.values())]
    write_entry(entry, _arrays(study), _meta(study, path, read_from), keep=CACHE_ENTRIES)
    return study


def _entry_name(path: Path) -> str:
    return hashlib.sha256(f"study v{STUDY_CACHE_VERSION} {path}".encode()).hexdigest()[:32]


def _listing(path: Path) -> list[str]:
    """The NIfTI files of a study folder (a file added or removed changes what a BraTS folder holds;
    anything else written there, a run folder say, does not)."""
    return sorted(p.name for p in path.iterdir() if p.name.endswith(NIFTI_SUFFIXES)) if path.is_dir() else []


def _stamps(paths: list[Path]) -> dict[str, list[int]] | None:
    """Size and modification time (ns) of each file; None if one is missing."""
    try:
        stats = {str(p): p.stat() for p in paths}
    except OSError:
        return None
    return {name: [stat.st_size, stat.st_mtime_ns] for name, stat in stats.items()}


def _arrays(study: Study) -> dict[str, np.ndarray]:
    arrays = {f"channel{index}": array for index, array in enumerate(study.channels.values())}
    arrays["affine"] = study.affine
    arrays.update({name: getattr(study, name) for name in OPTIONAL if getattr(study, name) is not None})
    return arrays


def _meta(study: Study, path: Path, read_from: list[Path]) -> dict[str, Any]:
    return {
        "study": str(path),
        "listing": _listing(path),
        "name": study.name,
        "channels": list(study.channels),
        "structures": {name: list(labels) for name, labels in study.structures.items()},
        "sources": study.sources,
        "colors": {name: list(rgb) for name, rgb in study.colors.items()},
        "exact_surfaces": study.exact_surfaces,
        "files": _stamps(read_from),
    }


def _from_entry(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> Study | None:
    """The cached study, or None if its files changed since (or the entry does not hold a whole study)."""
    try:
        files = meta["files"]
        if not files or _stamps([Path(p) for p in files]) != files or _listing(Path(meta["study"])) != meta["listing"]:
            return None
        channels = {name: arrays[f"channel{index}"] for index, name in enumerate(meta["channels"])}
        study = Study(
            name=meta["name"],
            channels=channels,
            affine=arrays["affine"],
            structures={name: tuple(labels) for name, labels in meta["structures"].items()},
            sources=dict(meta["sources"]),
            colors={name: tuple(rgb) for name, rgb in meta["colors"].items()},
            exact_surfaces=meta.get("exact_surfaces"),
            **{name: arrays.get(name) for name in OPTIONAL},
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    shapes = {array.shape for array in [*channels.values(), *(arrays.get(n) for n in OPTIONAL)] if array is not None}
    return study if len(shapes) == 1 and len(next(iter(shapes))) == 3 else None
