"""The task list of a cohort: which studies, each under a name that is its folder in the cohort's output.

LIST is one of:

- a folder of studies: every sub-folder holding a ``manifest.json`` or NIfTI files, in name order;
- a CSV file with a ``study`` (or ``path``) column and, optionally, ``name``; or, for generated studies,
  ``case`` with optional ``seed``, ``spacing`` and ``labels`` (see :func:`~NeuralRaycastLib.study.sample.write_sample`);
- a JSON file: a list (or ``{"studies": [...]}``) of paths or of objects with the CSV's keys;
- a glob pattern (``/data/brats/*/``, ``cases/**/manifest.json``), expanded in name order.

Relative paths in a CSV or JSON file are taken from the file's folder. Paths are not checked here: they may
name shared storage only the workers see, and a missing study fails as its own task, not the cohort.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: What a generated study's entry may say beyond its case, and how each is read.
GENERATED_KEYS = ("seed", "spacing", "labels")
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


class TaskListError(ValueError):
    """A task list that cannot be read; the message names the list and what to fix."""


@dataclass(frozen=True)
class StudyTask:
    """One study of a cohort: ``study`` (a study folder or manifest) or a generated one (``case``, with
    ``options`` for :func:`~NeuralRaycastLib.study.sample.write_sample`), trained into the folder ``name``."""

    name: str
    study: str | None = None
    case: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        """The study as a person would name it: its path, or the generated case and its options."""
        if self.study is not None:
            return self.study
        extra = "".join(f", {key} {value}" for key, value in self.options)
        return f"generated {self.case}{extra}"


def read_task_list(source: str) -> list[StudyTask]:
    """The tasks LIST stands for (see the module docstring), each with a unique, file-safe name."""
    path = Path(source).expanduser()
    if path.is_dir():
        entries = [{"study": os.path.abspath(p)} for p in sorted(path.iterdir()) if _looks_like_study(p)]
        if not entries:
            raise TaskListError(f"{path}: no studies in this folder (sub-folders with a manifest.json or NIfTI "
                                "files); give a folder of study folders, a CSV or JSON list, or a glob")
    elif path.is_file() and path.suffix.lower() == ".csv":
        entries = _csv_entries(path)
    elif path.is_file() and path.suffix.lower() == ".json":
        entries = _json_entries(path)
    elif glob.has_magic(source):
        entries = [{"study": os.path.abspath(p)} for p in sorted(glob.glob(str(path), recursive=True))]
        if not entries:
            raise TaskListError(f"{source}: the pattern matches nothing; check it (quote it so the shell leaves it "
                                "to neuralraycast)")
    else:
        raise TaskListError(f"{source}: not a folder of studies, a .csv or .json list, or a glob pattern; "
                            "check the path")
    return _named([_task(entry, path.parent if path.is_file() else path, where) for where, entry in
                   enumerate(entries, 1)], source)


def _looks_like_study(path: Path) -> bool:
    return path.is_dir() and ((path / "manifest.json").is_file() or any(path.glob("*.nii*")))


def _csv_entries(path: Path) -> list[dict[str, Any]]:
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        raise TaskListError(f"{path}: no rows; give a header with a 'study' column and a row per study")
    columns = set(rows[0])
    if not columns & {"study", "path", "case"}:
        raise TaskListError(f"{path}: no 'study' (or 'path', or 'case') column; the header has "
                            f"{', '.join(sorted(c for c in columns if c)) or 'nothing'}")
    return [{key: value for key, value in row.items() if key and value not in (None, "")} for row in rows]


def _json_entries(path: Path) -> list[Any]:
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise TaskListError(f"{path}: not valid JSON ({error}); give a list of study paths") from error
    if isinstance(data, dict) and "studies" in data:
        data = data["studies"]
    if not isinstance(data, list) or not data:
        raise TaskListError(f"{path}: give a non-empty list of study paths (or {{\"studies\": [...]}})")
    return data


def _task(entry: Any, base: Path, where: int) -> StudyTask:
    """One entry (a path, or a dict with 'study'/'path' or 'case') as a task; its name not yet unique."""
    if isinstance(entry, str):
        entry = {"study": entry}
    if not isinstance(entry, dict):
        raise TaskListError(f"entry {where}: {entry!r} is neither a path nor an object with 'study' or 'case'")
    study = entry.get("study", entry.get("path"))
    name = entry.get("name")
    if study is not None:
        # Absolute (a worker's working folder is not this one's), symbolic links kept: a shared mount's path
        # is the same on every node, where what it resolves to may not be.
        resolved = Path(os.path.abspath(base / Path(str(study)).expanduser()))
        study = str(resolved)
        name = name or (resolved.parent.name if resolved.suffix == ".json" else resolved.name)
        return StudyTask(_safe(str(name)), study=study)
    case = entry.get("case")
    if case is None:
        raise TaskListError(f"entry {where}: give 'study' (a path) or 'case' (a generated study)")
    options = tuple((key, _number(entry[key])) for key in GENERATED_KEYS if key in entry)
    name = name or "-".join([str(case), *(f"{key}{value}" for key, value in options)])
    return StudyTask(_safe(str(name)), case=str(case), options=options)


def _number(value: Any) -> Any:
    """A CSV's text as the number it spells (JSON's values are kept)."""
    if not isinstance(value, str):
        return value
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _safe(name: str) -> str:
    return _SAFE.sub("_", name).strip("._") or "study"


def _named(tasks: list[StudyTask], source: str) -> list[StudyTask]:
    """The tasks with names that are unique: a name shared by several gets a short digest of what it stands
    for, so that it stays the same on every rerun of the list."""
    if not tasks:
        raise TaskListError(f"{source}: no studies listed")
    counts: dict[str, int] = {}
    for task in tasks:
        counts[task.name] = counts.get(task.name, 0) + 1
    named, seen = [], set()
    for task in tasks:
        name = task.name
        if counts[name] > 1:
            name = f"{name}-{hashlib.sha256(task.describe().encode()).hexdigest()[:8]}"
        if name in seen:
            raise TaskListError(f"{source}: {task.describe()} is listed twice; list each study once")
        seen.add(name)
        named.append(StudyTask(name, task.study, task.case, task.options))
    return named
