"""One study of a cohort in a process of its own: ``python -m NeuralRaycastLib.cohort.study_process JOB``.

JOB is one JSON argument (:func:`job_argument`: the task, the cohort's folder, the training options and the
function that words a failure). The process runs :func:`~NeuralRaycastLib.cohort.study_task.run_study` and
prints the study's record as one JSON line on standard output, its only output there: everything else
(native libraries' messages included) goes to standard error. The runner that starts it gives it its GPU by
``CUDA_VISIBLE_DEVICES``, so the device it opens is its own, and a crash of the process loses this study only.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from .. import strict_json
from .study_task import FitOptions, run_study
from .tasks import StudyTask

MODULE = __name__


def job_argument(task: StudyTask, out: str, options: FitOptions,
                 describe: Callable[[BaseException], str] | None) -> str:
    """The JOB argument for ``task``; ``describe`` goes by its importable name (None where it has none)."""
    return json.dumps({"task": asdict(task), "out": out, "options": asdict(options),
                       "describe": _name_of(describe)})


def read_job(text: str) -> tuple[StudyTask, str, FitOptions, Callable[[BaseException], str] | None]:
    """What :func:`job_argument` wrote."""
    job = json.loads(text)
    task = job["task"]
    task = StudyTask(task["name"], task.get("study"), task.get("case"),
                     tuple((key, value) for key, value in task.get("options") or ()))
    options = FitOptions(**{**job["options"], "meshes": tuple(job["options"].get("meshes") or ())})
    return task, job["out"], options, _function(job.get("describe"))


def _name_of(function: Callable[..., Any] | None) -> str | None:
    """``module:name`` that imports ``function`` in another process (a module run with ``-m`` by its own
    name, not ``__main__``), or None where nothing would."""
    module, name = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    if module == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = getattr(spec, "name", None)
    return None if function is None or module is None or "<" in name else f"{module}:{name}"


def _function(name: str | None) -> Callable[[BaseException], str] | None:
    if not name:
        return None
    module, _, path = name.partition(":")
    found: Any = importlib.import_module(module)
    for part in path.split("."):
        found = getattr(found, part)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if len(arguments) != 1:
        print(f"usage: python -m {MODULE} JOB (one JSON argument)", file=sys.stderr)
        return 2
    task, out, options, describe = read_job(arguments[0])
    sys.stdout.flush()
    records = os.fdopen(os.dup(1), "w")  # the record's channel; descriptor 1 becomes standard error
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    record = run_study(task, out, options, describe)
    records.write(strict_json.dumps(record) + "\n")
    records.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
