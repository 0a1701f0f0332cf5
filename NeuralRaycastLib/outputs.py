"""Where results may be written: an output folder is checked before any work starts, so a run that would fail
to save, or would write over a study or another study's run, is refused at once instead of after its work.

Every command with an output, and :func:`~NeuralRaycastLib.train.run.train_study`, calls
:func:`check_output` first.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


class OutputError(ValueError):
    """An output that cannot or must not be written; the message says why and what to do instead."""


def check_output(out: str | Path, source: str | Path | None = None, *, overwrite: bool = False,
                 run_of: str | None = None) -> Path:
    """Refuse an output folder ``out`` that is an existing file, cannot be written, is (or is inside, or
    contains) the input folder ``source`` (a study, its manifest or a run folder), or is not empty; returns
    ``out`` as a path. Nothing is created.

    A non-empty folder is accepted with ``overwrite``, or when it is a run folder of the study ``run_of`` (the
    resolved study path that ``train_study`` records in ``run.json``); what may then be replaced, and how,
    is the writer's to say (``files.StagedFolder``: a folder is only ever replaced whole by one of its kind).
    """
    path = Path(out).expanduser()
    resolved = _resolve(path)
    if resolved.exists() and not resolved.is_dir():
        raise OutputError(f"{path} is a file, not a folder; choose a folder name for the output")
    existing = _nearest_existing(resolved)
    if not existing.is_dir():
        raise OutputError(f"{existing} is a file, so {path} cannot be made a folder; choose another output folder")
    if source is not None:
        _check_apart(path, resolved, Path(source).expanduser())
    _probe_writable(existing)
    if resolved.is_dir() and _has_entries(resolved) and not overwrite:
        if run_of is not None and _same_study(_run_study(resolved), run_of):
            return path  # the same study's run, which this one replaces
        other = _run_study(resolved) if run_of is not None else None
        what = f"a run of another study ({other})" if other else "not empty"
        raise OutputError(f"{path} is {what}; choose a new or empty folder, or pass --overwrite to write over it")
    return path


def _resolve(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as error:  # a symbolic link loop (RuntimeError before Python 3.13)
        raise OutputError(f"{path} cannot be resolved ({error}); choose another output folder") from error


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest parent that exists (the root always does)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _study_folder(source: Path) -> Path:
    """The folder of an input: itself, or the folder of a file (a manifest) inside it."""
    resolved = _resolve(source)
    return resolved if resolved.is_dir() or not resolved.exists() else resolved.parent


def _check_apart(path: Path, resolved: Path, source: Path) -> None:
    """Results written into a study would turn it into something else (a run folder a later ``mesh`` reads
    as one); a study inside the output would be written over."""
    folder = _study_folder(source)
    if resolved == folder:
        raise OutputError(f"{path} is the input's own folder; choose an output folder outside it")
    if folder in resolved.parents:
        raise OutputError(f"{path} is inside the input folder {folder}; choose an output folder outside it")
    if resolved in folder.parents:
        raise OutputError(f"{path} contains the input {source}; choose an output folder that does not contain it")


def _probe_writable(folder: Path) -> None:
    """Create and remove a file in ``folder``: permission bits alone say nothing as root, nor on a read-only
    file system."""
    try:
        handle, probe = tempfile.mkstemp(prefix=".neuralraycast-probe-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise OutputError(f"cannot write in {folder} ({error.strerror or error}); "
                          "choose a writable folder for the output") from error


def _has_entries(folder: Path) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(True for _ in entries)
    except OSError as error:
        raise OutputError(f"cannot list {folder} ({error.strerror or error}); "
                          "choose a readable, writable folder for the output") from error


def _same_study(recorded: str | None, study: str) -> bool:
    """Whether a run's recorded study is ``study``: a folder and its ``manifest.json`` are one study."""
    if recorded is None:
        return False

    def folder_of(path: str) -> Path:
        resolved = Path(path).resolve()
        return resolved.parent if resolved.name == "manifest.json" else resolved

    try:
        return folder_of(recorded) == folder_of(study)
    except (OSError, RuntimeError):  # a recorded path that loops
        return False


def _run_study(folder: Path) -> str | None:
    """The study a run folder was trained on, as its ``run.json`` records it (None: not a run folder, a study
    held in memory, or a ``run.json`` that cannot be read)."""
    try:
        study = json.loads((folder / "run.json").read_text()).get("study")
    except (OSError, ValueError, AttributeError):
        return None
    return study if isinstance(study, str) else None
