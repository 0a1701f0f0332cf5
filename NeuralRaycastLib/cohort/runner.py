"""Run a cohort: every study of the list as a task (study_task.py), in this process one after another, on this
machine's GPUs without Ray (local_gpus.py: a process per study, several at once), or on a Ray cluster, each
task asking for a share of a GPU sized from the GPU memory budget (or a CPU where the cluster has no GPUs).
Studies already done are skipped, so running the same command again finishes an interrupted cohort; the
summary is rewritten as each study finishes.

Ray (``pip install .[cohort]``) is imported only when asked for: ``ray_address`` is ``auto`` or
``ray://host:port`` (an existing cluster; every node needs this package installed and the output folder, and
the studies, at the same paths, e.g. shared storage), or :data:`LOCAL` (a cluster on this machine, of
``cpus`` and ``gpus`` where given). A process already connected to Ray (``ray.init`` called) is used as it is.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..files import write_text
from ..gpu.memory_budget import GIB, SAFETY_MARGIN, format_bytes, parse_memory
from .local_gpus import run_on_slots
from .study_task import FitOptions, finished_record, node_lock, record_failure, remove_leftovers, run_study
from .summary import format_seconds, progress_line, write_summary
from .tasks import StudyTask

LOCAL = "local"
#: ``gpus``: every GPU of this machine (``nvidia-smi -L``, or ``CUDA_VISIBLE_DEVICES`` where set).
AUTO = "auto"
#: What a task's process takes on its GPU beyond its budget (its CUDA context and kernels): an estimate, kept
#: free between the studies sharing a GPU (docs/cohorts.md).
PROCESS_BYTES = 1 * GIB
#: How often (seconds) the runner looks at the tasks while none finishes.
POLL_S = 5.0
#: Times Ray runs a task again whose worker or node died (a study's own failure is never retried).
RETRIES = 2
INSTALL_RAY = ("Ray is not installed; install it with: pip install 'neuralraycast[cohort]' (or pip install "
               "'ray[default]')")


class CohortBusyError(ValueError):
    """Another cohort run holds the output folder's lock."""


class RayNotInstalledError(ValueError):
    """Ray was asked for and is not installed; the message says how to install it."""


class StudiesFailedError(ValueError):
    """Some studies of a cohort failed (the others are done); the message says where their errors are."""


@dataclass(frozen=True)
class Cluster:
    """Where the tasks run. ``ray_address`` None: on this machine, one after another in this process, or, given
    ``gpus`` (a number or :data:`AUTO`), without Ray on that many GPUs, a process per study (local_gpus.py).
    ``cpus``/``gpus`` size a :data:`LOCAL` Ray cluster (``gpus`` :data:`AUTO`: as Ray finds them).
    ``studies_per_gpu`` overrides how many share a GPU (else sized from the budget)."""

    ray_address: str | None = None
    cpus: int | None = None
    gpus: int | str | None = None
    studies_per_gpu: int | None = None
    cpus_per_study: float = 1.0


@dataclass
class CohortResult:
    total: int
    done: int
    skipped: int
    failed: int
    seconds: float

    @property
    def studies_per_hour(self) -> float:
        """Studies trained (not skipped) per hour of this run's wall time."""
        return (self.done - self.skipped) / self.seconds * 3600 if self.seconds > 0 else 0.0


def studies_per_gpu(budget: int | None, gpu_bytes: int | None) -> int:
    """How many studies of ``budget`` bytes each share a GPU of ``gpu_bytes``: what the GPU holds beyond its
    safety margin, a study's budget and :data:`PROCESS_BYTES` each; 1 where either is unknown."""
    if budget is None or gpu_bytes is None:
        return 1
    least, fraction = SAFETY_MARGIN
    usable = gpu_bytes - max(least, int(gpu_bytes * fraction))
    return max(1, usable // (budget + PROCESS_BYTES))


def gpu_fraction(per_gpu: int) -> float:
    """The share of a GPU a task asks Ray for, so that ``per_gpu`` of them fit on one (rounded down)."""
    return 1.0 if per_gpu <= 1 else math.floor(10000 / per_gpu) / 10000


def budget_for_share(per_gpu: int, gpu_bytes: int) -> int:
    """Each study's budget where ``per_gpu`` share a GPU of ``gpu_bytes`` (the inverse of :func:`studies_per_gpu`)."""
    least, fraction = SAFETY_MARGIN
    usable = gpu_bytes - max(least, int(gpu_bytes * fraction))
    return max(GIB // 4, usable // per_gpu - PROCESS_BYTES)


class Tracker:
    """The cohort's state as tasks finish: rows for the summary, counts, the estimate of the time left."""

    def __init__(self, out: Path, tasks: list[StudyTask], echo: Callable[[str], None]) -> None:
        self.out, self.echo, self.start = out, echo, time.time()
        self.rows: dict[str, dict[str, Any]] = {t.name: {"name": t.name, "study": t.describe(), "status": "waiting"}
                                                for t in tasks}
        self.skipped = self.finished_here = 0
        self.running = 0

    def skip(self, record: dict[str, Any]) -> None:
        self.rows[record["name"]] = {**record, "reused": True}
        self.skipped += 1

    def finish(self, record: dict[str, Any]) -> None:
        if record.get("reused"):  # done meanwhile by a run before this one
            self.skip(record)
        else:
            self.rows[record["name"]] = record
            self.finished_here += 1
        self.running = min(self.running, self.count("waiting"))
        what = (f"done in {record.get('seconds', 0):.1f} s" + (f", PSNR {record['psnr']:.2f} dB"
                                                              if isinstance(record.get("psnr"), float) else "")
                if record.get("status") == "done" else f"FAILED: {record.get('error')}")
        self.echo(f"cohort: {record['name']} {what}")
        self.write()
        self.echo(f"cohort: {progress_line(self.progress())}")

    def count(self, status: str) -> int:
        return sum(row.get("status") == status for row in self.rows.values())

    def progress(self) -> dict[str, Any]:
        elapsed = time.time() - self.start
        left = self.count("waiting")
        rate = self.finished_here / elapsed if self.finished_here and elapsed > 0 else None
        return {"total": len(self.rows), "done": self.count("done"), "skipped": self.skipped,
                "failed": self.count("failed"), "running": min(self.running, left),
                "waiting": max(0, left - self.running), "elapsed": round(elapsed, 1),
                "seconds_left": None if rate is None else round(left / rate, 1)}

    def write(self) -> None:
        write_summary(self.out, list(self.rows.values()), self.progress())


def run_cohort(tasks: list[StudyTask], out: str | Path, options: FitOptions, cluster: Cluster | None = None,
               echo: Callable[[str], None] = print,
               describe: Callable[[BaseException], str] | None = None) -> CohortResult:
    """Train every study of ``tasks`` not yet done into ``out`` (see the module docstring); returns the counts.
    ``describe`` makes a failed study's one-line message (the command line's). Refuses (CohortBusyError) an
    output folder another cohort run is writing into."""
    cluster = cluster or Cluster()
    if cluster.ray_address is not None:
        import_ray()  # missing: said before anything is written
    devices = None
    if cluster.ray_address is None and cluster.gpus is not None:
        devices, options = local_slots(cluster, options, echo)  # more GPUs than there are: said before any write
    out = Path(os.path.abspath(Path(out).expanduser()))  # the same path on every worker, whatever its folder
    out.mkdir(parents=True, exist_ok=True)
    with node_lock(out / "cohort.lock", wait=False) as held:
        if not held:
            raise CohortBusyError(f"{out}: another cohort run is writing into this folder; wait for it to end, "
                                  "or choose another --out")
        for path in remove_leftovers(out, {task.name for task in tasks}):
            echo(f"cohort: removed {path.name}, left by a study that did not finish")
        write_text(out / "tasks.json", json.dumps([asdict(task) for task in tasks], indent=1) + "\n")
        tracker = Tracker(out, tasks, echo)
        pending = []
        for task in tasks:
            record = finished_record(out, task.name)
            if record is None:
                pending.append(task)
            else:
                tracker.skip(record)
        if tracker.skipped:
            echo(f"cohort: {tracker.skipped} of {len(tasks)} studies already done in {out} (skipped)")
        tracker.write()
        if cluster.ray_address is not None:
            results = _on_ray(pending, out, options, cluster, tracker, echo, describe)
        elif devices is not None:
            results = run_on_slots(pending, out, options, devices, lambda count: setattr(tracker, "running", count),
                                   describe)
        else:
            results = _in_process(pending, out, options, tracker, describe)
        with contextlib.closing(results):  # an interrupt ends what still runs, at once
            for record in results:
                tracker.finish(record)
        tracker.write()
    seconds = time.time() - tracker.start
    result = CohortResult(len(tasks), tracker.count("done"), tracker.skipped, tracker.count("failed"), seconds)
    echo(f"cohort: {result.done} of {result.total} studies done ({result.skipped} skipped), {result.failed} failed; "
         f"{format_seconds(seconds)} wall ({seconds:.1f} s), {result.studies_per_hour:.1f} studies/hour; "
         f"summary {out / 'summary.html'}")
    return result


def _in_process(pending: list[StudyTask], out: Path, options: FitOptions, tracker: Tracker,
                describe: Callable[[BaseException], str] | None) -> Iterator[dict[str, Any]]:
    for task in pending:
        tracker.running = 1
        yield run_study(task, str(out), options, describe)


def local_slots(cluster: Cluster, options: FitOptions, echo: Callable[[str], None]
                ) -> tuple[list[str | None], FitOptions]:
    """The slots of a cohort on this machine's GPUs without Ray: the ``CUDA_VISIBLE_DEVICES`` of each (the
    GPUs in turn, so that the first studies go to different GPUs; None where no GPU is listed: the device
    this machine opens), and the options with each study's budget where several share a GPU."""
    found, source = machine_gpus()
    plural = "s" if len(found) != 1 else ""
    if cluster.gpus == AUTO:
        gpus: list[str | None] = list(found) or [None]
        where = f"{len(found)} GPU{plural} ({source})" if found else None
    else:
        count = int(cluster.gpus or 0)
        if count < 1:
            raise ValueError(f"--gpus must be at least 1 without --ray-address (got {count})")
        if found and count > len(found):
            raise ValueError(f"--gpus {count}: this machine has {len(found)} GPU{plural} ({source}); give at most "
                             f"{len(found)}, or --gpus auto")
        gpus = list(found[:count]) if found else [str(index) for index in range(count)]
        where = (f"{count} of {len(found)} GPU{plural} ({source})" if found else
                 f"{count} GPU{'s' if count > 1 else ''} as given (none listed: {source})")
    per_gpu, options, budget = gpu_share(cluster.studies_per_gpu, options, _smallest_gpu_bytes)
    devices = [gpu for _ in range(per_gpu) for gpu in gpus]
    studies = f"{per_gpu} stud{'ies' if per_gpu > 1 else 'y'}" + (
        f" of {format_bytes(budget)} each" if budget is not None else "")
    echo(f"cohort: {where}, {studies} per GPU: {len(devices)} at once, each in a process of its own" if where else
         f"cohort: no GPU listed ({source}): {studies} at once on this machine's device, each in a process of its own")
    return devices, options


def machine_gpus() -> tuple[list[str], str]:
    """This machine's GPUs as ``CUDA_VISIBLE_DEVICES`` values, and where that was read: the variable's own
    list where it is set (a scheduler's share of the machine), else ``nvidia-smi -L``; empty where neither."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [part.strip() for part in visible.split(",") if part.strip()], "CUDA_VISIBLE_DEVICES"
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return [], "no nvidia-smi"
    try:
        text = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return [], "nvidia-smi -L failed"
    count = sum(line.startswith("GPU ") for line in text.splitlines())
    return [str(index) for index in range(count)], "nvidia-smi -L"


def gpu_share(per_gpu: int | None, options: FitOptions, gpu_bytes: Callable[[], int | None]
              ) -> tuple[int, FitOptions, int | None]:
    """How many studies share a GPU (``per_gpu`` where given, else as many as their budgets fit), the options
    with each study's budget (given several per GPU without one: the GPU's share), and that budget. Calls
    ``gpu_bytes`` (the GPUs' memory) only where it is needed."""
    budget = None if options.gpu_memory is None else parse_memory(options.gpu_memory)
    if per_gpu is None:
        return (1 if budget is None else studies_per_gpu(budget, gpu_bytes())), options, budget
    if per_gpu > 1 and budget is None:
        size = gpu_bytes()
        if size is None:
            raise ValueError("--studies-per-gpu: the GPUs' memory cannot be read here (no nvidia-smi); give each "
                             "study's budget with --gpu-memory as well")
        budget = budget_for_share(per_gpu, size)
        options = replace(options, gpu_memory=str(budget))
    return per_gpu, options, budget


def import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise RayNotInstalledError(INSTALL_RAY) from error
    return ray


def _connect(ray: Any, cluster: Cluster) -> bool:
    """Connect to the cluster asked for; True where this call started the connection (and ends it)."""
    if ray.is_initialized():
        return False
    if cluster.ray_address == LOCAL:
        ray.init(num_cpus=cluster.cpus, num_gpus=None if cluster.gpus == AUTO else cluster.gpus,
                 include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=cluster.ray_address, log_to_driver=False)
    return True


def _on_ray(pending: list[StudyTask], out: Path, options: FitOptions, cluster: Cluster, tracker: Tracker,
            echo: Callable[[str], None], describe: Callable[[BaseException], str] | None
            ) -> Iterator[dict[str, Any]]:
    ray = import_ray()
    started = _connect(ray, cluster)
    futures: dict[Any, StudyTask] = {}
    try:
        resources, options, slots = _task_resources(ray, cluster, options, echo)
        # On a GPU each task gets a fresh worker process (max_calls 1): Ray gives every task its GPU by
        # CUDA_VISIBLE_DEVICES, which a process that has opened its device already would not follow.
        remote = ray.remote(max_calls=1 if resources["num_gpus"] else 0, **resources)(run_study)
        futures = {remote.options(name=f"study {task.name}", max_retries=RETRIES)
                   .remote(task, str(out), options, describe): task for task in pending}
        while futures:
            tracker.running = min(len(futures), slots)
            ready, _ = ray.wait(list(futures), num_returns=1, timeout=POLL_S)
            for ref in ready:
                task = futures.pop(ref)
                try:
                    yield ray.get(ref)
                except ray.exceptions.RayError as error:  # its worker or node died, past the retries
                    yield record_failure(out, task, f"its worker was lost ({type(error).__name__}); run the cohort "
                                         "again to train it", str(error), 0.0)
    finally:
        for ref in futures:  # interrupted: stop what still runs (each loses only its own study)
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()


def _task_resources(ray: Any, cluster: Cluster, options: FitOptions, echo: Callable[[str], None]
                    ) -> tuple[dict[str, Any], FitOptions, int]:
    """What each task asks Ray for, the options it runs with (its share's budget) and how many run at once."""
    resources = ray.cluster_resources()
    gpus, cpus = resources.get("GPU", 0.0), resources.get("CPU", 1.0)
    if gpus <= 0:
        echo(f"cohort: no GPUs in the Ray cluster: {int(cpus // cluster.cpus_per_study)} studies at once on "
             f"{cpus:g} CPUs")
        return {"num_cpus": cluster.cpus_per_study, "num_gpus": 0}, options, max(1, int(cpus // cluster.cpus_per_study))
    per_gpu, options, budget = gpu_share(cluster.studies_per_gpu, options, lambda: gpu_memory_bytes(ray))
    share = f" of {format_bytes(budget)} each" if budget is not None else ""
    echo(f"cohort: {gpus:g} GPU{'s' if gpus != 1 else ''} in the Ray cluster, {per_gpu} "
         f"stud{'ies' if per_gpu > 1 else 'y'}{share} per GPU")
    return ({"num_gpus": gpu_fraction(per_gpu), "num_cpus": cluster.cpus_per_study}, options,
            max(1, int(gpus * per_gpu)))


def gpu_memory_bytes(ray: Any) -> int | None:
    """The memory of the smallest GPU of a node of the cluster (one task on a GPU asks nvidia-smi), or None."""
    try:
        return ray.get(ray.remote(_smallest_gpu_bytes).options(num_gpus=1, num_cpus=0).remote(), timeout=120)
    except Exception:  # no answer: one study per GPU
        return None


def _smallest_gpu_bytes() -> int | None:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        text = subprocess.run([tool, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=True).stdout
        return min(int(float(line)) for line in text.split() if line.strip()) * (1 << 20)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
