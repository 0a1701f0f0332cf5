"""Training in a process of its own: the progress stream ``fit --progress-json`` writes, and the class that
starts such a process, reads that stream, asks it to stop and ends it.

A fault of the GPU or its driver then ends the worker, not the program that started it (Slicer, with the
user's unsaved scene). Standard library only: the Slicer module runs this in Slicer's own process, where
the backend's packages may not be installed yet.

The stream, one JSON object per line on standard output::

    {"event": "progress", "stage": "geometry", "message": "...", "fraction": 0.4, "loss": 0.01, "heldout_psnr": null}
    {"event": "done", "run_folder": "...", "cancelled": false, "seconds": 12.3, "heldout_psnr": 31.2}
    {"event": "error", "message": "one line: what is wrong and what to do"}

A line ``stop`` on the worker's standard input asks it to stop after the current step, keeping the state
reached; standard input closing (the program that started it ended) asks the same.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..processes import describe_exit, kill_tree, own_group

#: The line on a worker's standard input that asks it to stop.
STOP = "stop"
#: Names of the training stages as the trainer's messages number them.
_STAGES = {"stage 1": "geometry", "stage 2": "appearance", "stage 3": "joint"}
_LOSS = re.compile(r"\bloss ([-+0-9.eE]+|nan|inf)")
_PSNR = re.compile(r"held-out PSNR ([-+0-9.eE]+) dB")


# --- the worker's side -----------------------------------------------------------------------------------------


def _number(pattern: re.Pattern, text: str) -> float | None:
    match = pattern.search(text)
    if match is None:
        return None
    try:
        value = float(match.group(1))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def progress_event(message: str, fraction: float) -> dict:
    """The stream's progress object for a ``progress(message, fraction)`` call; the loss and held-out PSNR are
    read from the trainer's messages (``stage 2: loss 0.0123, held-out PSNR 28.40 dB``)."""
    message = str(message)
    head = message.split(":", 1)[0].strip() if ":" in message else message.strip()
    return {"event": "progress", "stage": _STAGES.get(head, head), "message": message,
            "fraction": min(max(float(fraction), 0.0), 1.0), "loss": _number(_LOSS, message),
            "heldout_psnr": _number(_PSNR, message)}


class JsonLines:
    """Writes the stream's objects to ``stream``, one line each, flushed at once (the reader shows them live)."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stdout
        self.lock = threading.Lock()

    def write(self, event: dict) -> None:
        event = {key: None if isinstance(value, float) and not math.isfinite(value) else value
                 for key, value in event.items()}
        line = json.dumps(event, allow_nan=False)
        with self.lock:
            self.stream.write(line + "\n")
            self.stream.flush()

    def __call__(self, message: str, fraction: float) -> None:
        """A ``progress(message, fraction)`` callback."""
        self.write(progress_event(message, fraction))


class StopOnStdin:
    """A ``should_stop()`` that turns True once standard input says ``stop`` or closes."""

    def __init__(self, stream=None) -> None:
        self.requested = threading.Event()
        thread = threading.Thread(target=self._read, args=(stream or sys.stdin,), daemon=True,
                                  name="stop-requests")
        thread.start()

    def _read(self, stream) -> None:
        try:
            for line in stream:
                if line.strip() == STOP:
                    break
        except (OSError, ValueError):  # no standard input: a closed one asks to stop too
            pass
        self.requested.set()

    def __call__(self) -> bool:
        return self.requested.is_set()


# --- the starting program's side -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """One progress report of the worker."""

    stage: str
    message: str
    fraction: float
    loss: float | None = None
    heldout_psnr: float | None = None


@dataclass(frozen=True)
class Outcome:
    """How a worker ended. ``state``: done, cancelled (``run_folder`` set if the state reached was saved),
    failed (the worker's own one-line error), or crashed (it ended without saying why: killed, a fault)."""

    state: str
    message: str
    run_folder: str | None = None
    returncode: int | None = None
    heldout_psnr: float | None = None

    @property
    def trained(self) -> bool:
        """A run folder was written (a complete run, or a cancelled one's saved state)."""
        return self.run_folder is not None


class WorkerProcess:
    """A worker process whose standard output is the JSON stream above.

    ``start`` launches it in a process group of its own (POSIX; on Windows the tree is ended with taskkill),
    so that ``kill`` ends it with every process it started (the warm-up's compilers). Two threads read its
    output into queues; ``poll`` (from a timer) and ``wait`` (blocking) never block on the pipes themselves.
    """

    def __init__(self, command: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None,
                 name: str = "the training process") -> None:
        self.command, self.env, self.cwd, self.name = [str(part) for part in command], env, cwd, name
        self.process: subprocess.Popen | None = None
        self._events: queue.Queue = queue.Queue()
        self._stderr: list[str] = []
        #: The last lines of its standard output that are not the stream (``fit``'s summary lines, say).
        self.printed: list[str] = []
        self._readers: list[threading.Thread] = []
        self._done: dict | None = None
        self._error: str | None = None
        self._killed = False
        self._stop_requested = False
        self.outcome: Outcome | None = None
        #: A standby worker (``neuralraycast standby``) has said it is ready for its job (:meth:`poll_ready`), and
        #: what it did to get ready (its event's ``warmed``: the kernels it called ahead, in words).
        self.ready = False
        self.warmed: str | None = None
        #: The ``fit`` arguments sent to a standby worker (:meth:`send_job`), None before.
        self.job: list[str] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env,
            cwd=self.cwd, text=True, encoding="utf-8", errors="replace", bufsize=1, **own_group())
        self._readers = [threading.Thread(target=self._read_stdout, daemon=True, name="worker-stdout"),
                         threading.Thread(target=self._read_stderr, daemon=True, name="worker-stderr")]
        for reader in self._readers:
            reader.start()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.outcome is None

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            line = line.strip()
            if not line.startswith("{"):  # a library's own output, or the command's summary lines: not the stream
                if line:
                    self.printed.append(line)
                    del self.printed[:-50]
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                self._events.put(event)

    def _read_stderr(self) -> None:
        for line in self.process.stderr:
            if line.strip():
                self._stderr.append(line.rstrip())
                del self._stderr[:-50]

    def poll_ready(self) -> bool:
        """For a standby worker: whether it has said it is ready and is still running (never blocks; what it
        reported before its job is not progress of that job, and is dropped)."""
        if self.process is None or self.process.poll() is not None or self.outcome is not None:
            return False
        self._drain()
        return self.ready and self._error is None

    def send_job(self, arguments: Sequence[str]) -> None:
        """Hand a ready standby worker its one job: the arguments of ``neuralraycast fit`` (the study first). Its
        progress and outcome are then this worker's, as a ``fit`` worker's."""
        if not self.poll_ready():
            raise RuntimeError(f"{self.name} is not ready for a job")
        self.job = [str(argument) for argument in arguments]
        self.process.stdin.write(json.dumps({"fit": self.job}) + "\n")
        self.process.stdin.flush()

    def request_stop(self) -> None:
        """Ask the worker to stop after its current step and save the state reached."""
        self._stop_requested = True
        if self.process is None or self.process.poll() is not None:
            return
        try:
            self.process.stdin.write(STOP + "\n")
            self.process.stdin.flush()
        except (OSError, ValueError):  # it is ending already
            pass

    def kill(self) -> None:
        """End the worker and every process it started, at once; nothing more of its run is saved."""
        if self.process is None or self.process.poll() is not None:
            return
        self._killed = True
        kill_tree(self.process)
        self.process.wait()

    def poll(self) -> tuple[list[Progress], Outcome | None]:
        """Progress reported since the last call, and the outcome once the worker has ended (never blocks)."""
        if self.process is None:
            raise RuntimeError("the worker process was not started")
        ended = self.outcome is None and self.process.poll() is not None
        if ended:
            for reader in self._readers:  # the pipes are at their end: read what is left
                reader.join(timeout=5)
        progress = self._drain()
        if ended:
            self.outcome = self._outcome(self.process.returncode)
            for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
                with contextlib.suppress(OSError, ValueError):
                    pipe.close()
        return progress, self.outcome

    def wait(self, on_progress: Callable[[Progress], None] | None = None, interval: float = 0.2) -> Outcome:
        """Block until the worker ends, passing its progress to ``on_progress``; its outcome."""
        while True:
            progress, outcome = self.poll()
            for item in progress:
                if on_progress is not None:
                    on_progress(item)
            if outcome is not None:
                return outcome
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=interval)

    def _drain(self) -> list[Progress]:
        progress = []
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return progress
            kind = event.get("event")
            if kind == "progress":
                progress.append(Progress(str(event.get("stage", "")), str(event.get("message", "")),
                                         float(event.get("fraction") or 0.0), event.get("loss"),
                                         event.get("heldout_psnr")))
            elif kind == "ready":
                self.ready, self.warmed = True, str(event.get("warmed", ""))
            elif kind == "done":
                self._done = event
            elif kind == "error":
                self._error = str(event.get("message", ""))

    def _outcome(self, returncode: int) -> Outcome:
        done = self._done
        if done is not None and returncode in (0, 130):
            folder = done.get("run_folder")
            if done.get("cancelled"):
                return Outcome("cancelled", f"cancelled; the state reached is saved in {folder}", folder, returncode,
                               done.get("heldout_psnr"))
            return Outcome("done", f"trained into {folder}", folder, returncode, done.get("heldout_psnr"))
        if self._killed:
            return Outcome("cancelled", f"{self.name} was stopped; nothing was saved", None, returncode)
        if self._error is not None:
            return Outcome("failed", self._error, None, returncode)
        if self._stop_requested and returncode == 130:
            return Outcome("cancelled", f"{self.name} stopped before training; nothing was saved", None, returncode)
        last = self._stderr[-1].strip() if self._stderr else ""
        detail = f"; its last words: {last}" if last else ""
        return Outcome("crashed", f"{self.name} ended unexpectedly ({describe_exit(returncode)}); nothing was "
                       f"saved and the scene is unchanged{detail}", None, returncode)
