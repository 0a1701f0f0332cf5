"""A cohort on this machine's GPUs without Ray: a slot per study that may run at once (GPUs × studies per
GPU), each a thread that takes the next study waiting and trains it in a fresh process of its own
(:mod:`~NeuralRaycastLib.cohort.study_process`) with ``CUDA_VISIBLE_DEVICES`` set to the slot's GPU.

A process per study, as on Ray: the GPU a process opens is its own, and a process that crashes (a GPU fault,
the out-of-memory killer) loses its study only, which is recorded as failed while the others go on. Each
process runs in a process group of its own; an interrupt of the cohort (Ctrl-C) ends every one of them with
what it started (the warm-up's compilers), leaving at most ``.partial-`` folders, which the next run removes.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from ..processes import describe_exit, kill_tree, own_group
from .study_process import MODULE, job_argument
from .study_task import FitOptions, finished_record, one_line, record_failure
from .tasks import StudyTask

#: How often (seconds) the runner looks at the slots while no study finishes.
POLL_S = 2.0
#: The lines of a crashed process's standard error kept in its study's error record.
KEPT_LINES = 40


def study_command() -> list[str]:
    """The command that trains one study; its JOB argument follows."""
    return [sys.executable, "-m", MODULE]


def child_environment(device: str | None) -> dict[str, str]:
    """This process's environment for a study's process: its GPU (``device`` None: as this process sees
    them) and this package found first, the one this process runs, wherever it was imported from."""
    env = dict(os.environ)
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)])
    return env


class Children:
    """The study processes running now; :meth:`stop` ends them all and lets no new one start."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: set[subprocess.Popen] = set()
        self.stopping = False

    def start(self, command: Sequence[str], env: dict[str, str], output: IO[bytes], errors: IO[bytes]
              ) -> subprocess.Popen | None:
        """Start a study's process in a group of its own; None once stopping."""
        with self.lock:
            if self.stopping:
                return None
            process = subprocess.Popen(list(command), stdin=subprocess.DEVNULL, stdout=output, stderr=errors,
                                       env=env, **own_group())
            self.live.add(process)
            return process

    def wait(self, process: subprocess.Popen) -> int:
        """Wait for the process; then end what it left running in its group (its pid stays reserved until it is
        reaped, so the group is still its own), and reap it."""
        if os.name == "nt" or not hasattr(os, "waitid"):
            status = process.wait()
            with self.lock:
                self.live.discard(process)
            return status
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        with self.lock:
            kill_tree(process)
            self.live.discard(process)
        return process.wait()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            for process in self.live:
                kill_tree(process)


def run_on_slots(pending: list[StudyTask], out: Path, options: FitOptions, devices: Sequence[str | None],
                 on_running: Callable[[int], None], describe: Callable[[BaseException], str] | None,
                 command: Sequence[str] | None = None) -> Iterator[dict[str, Any]]:
    """Train ``pending`` with a slot per entry of ``devices`` (each a ``CUDA_VISIBLE_DEVICES`` value, or None);
    yields each study's record as it finishes. ``on_running`` hears how many studies are in flight. Closing the
    iterator (an interrupt) ends every study process."""
    waiting: queue.SimpleQueue[StudyTask] = queue.SimpleQueue()
    for task in pending:
        waiting.put(task)
    finished: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    children = Children()
    command = list(command or study_command())
    slots = [threading.Thread(target=_slot, args=(device, waiting, finished, children, command, out, options,
                                                  describe), daemon=True, name=f"cohort slot {index}")
             for index, device in enumerate(devices)]
    outstanding = len(pending)
    try:
        for slot in slots:
            slot.start()
        while outstanding:
            on_running(min(outstanding, len(slots)))
            try:
                record = finished.get(timeout=POLL_S)
            except queue.Empty:
                continue
            outstanding -= 1
            on_running(min(outstanding, len(slots)))
            yield record
    finally:
        children.stop()
        for slot in slots:
            slot.join(timeout=30)


def _slot(device: str | None, waiting: queue.SimpleQueue, finished: queue.SimpleQueue, children: Children,
          command: list[str], out: Path, options: FitOptions,
          describe: Callable[[BaseException], str] | None) -> None:
    """One slot: the next study waiting, in a process on ``device``, until none is left or the cohort stops."""
    while not children.stopping:
        try:
            task = waiting.get_nowait()
        except queue.Empty:
            return
        try:
            record = train_in_process(task, out, options, device, children, command, describe)
        except Exception as error:  # the slot's own failure (the process could not start, say): this study's
            record = record_failure(out, task, f"its process could not run ({one_line(error)})", repr(error), 0.0)
        if record is None:  # stopped
            return
        finished.put(record)


def train_in_process(task: StudyTask, out: Path, options: FitOptions, device: str | None, children: Children,
                     command: list[str], describe: Callable[[BaseException], str] | None) -> dict[str, Any] | None:
    """Train ``task`` in a process of its own on ``device``; its record (a crash is a failed one), or None
    where the cohort stopped meanwhile."""
    began = time.time()
    with tempfile.TemporaryFile() as output, tempfile.TemporaryFile() as errors:
        process = children.start([*command, job_argument(task, str(out), options, describe)],
                                 child_environment(device), output, errors)
        if process is None:
            return None
        status = children.wait(process)
        if children.stopping:
            return None
        record = _record(_text(output))
        if record is not None and record.get("name") == task.name:
            return record
        done = finished_record(out, task.name)  # finished, and crashed after (its device's teardown, say)
        if done is not None:
            return done
        said = _text(errors).splitlines()
        last = next((line.strip() for line in reversed(said) if line.strip()), "")
        words = f"; its last words: {last[:300]}" if last else ""
        return record_failure(out, task, f"its process ended unexpectedly ({describe_exit(status)}){words}; run "
                              "the cohort again to train it", "\n".join(said[-KEPT_LINES:]), time.time() - began)


def _text(stream: IO[bytes]) -> str:
    stream.seek(0)
    return stream.read().decode("utf-8", errors="replace")


def _record(text: str) -> dict[str, Any] | None:
    """The record a study's process printed (its last JSON line), or None."""
    for line in reversed(text.splitlines()):
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                return record
    return None


