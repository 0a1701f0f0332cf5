"""Where a run's wall clock and GPU memory go, phase by phase: reading the study, its boundary maps, compiling
kernels, the reference views, training and saving. ``fit`` prints the phases when it is done, ``train_log.json``
keeps them and ``bench --suite workstation`` tabulates them, so a slow or hungry step is named, not guessed.

The run's own phases follow one another, and their seconds add up to its wall clock. Work done on a thread of its
own while one of them runs (the field built while the boundary maps are made) is a phase *beside* that one: listed
with the phase it ran beside and left out of every sum, so no second is counted twice; what the run then still
waits for it is a phase of its own.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Phase:
    name: str
    seconds: float
    peak_bytes: int | None = None  # the largest sample of GPU memory in use during the phase; None: not read
    beside: str | None = None  # the run's phase this one ran beside, on a thread of its own (None: the run's own)
    started: float = 0.0  # perf_counter at its start: the order of the list

    def as_dict(self) -> dict:
        entry = {"name": self.name, "seconds": round(self.seconds, 3), "peak_bytes": self.peak_bytes}
        return entry if self.beside is None else {**entry, "beside": self.beside}

    def describe(self, digits: int = 1) -> str:
        """``name 1.2 s``, and the phase it ran beside where it did."""
        return f"{self.name} {self.seconds:.{digits}f} s" + (f" beside {self.beside}" if self.beside else "")


class PhaseClock:
    """Times named phases; where ``memory_in_use`` reads the GPU's memory (bytes, or None where it cannot), a
    thread samples it every ``interval`` seconds during each phase, so a phase's peak is the largest sample (a
    short spike between samples can be missed: the figure is a lower bound of the true peak)."""

    def __init__(self, memory_in_use: Callable[[], int | None] | None = None, interval: float = 0.02):
        self.phases: list[Phase] = []  # in the order they began
        self._lock = threading.Lock()  # a phase beside the run's ends on a thread of its own
        self._memory_in_use = memory_in_use
        self._interval = interval
        # A device that does not tell its memory is not asked again in every phase.
        self._reads_memory = memory_in_use is not None and memory_in_use() is not None

    @contextmanager
    def phase(self, name: str, beside: str | None = None) -> Iterator[None]:
        """Time the block as phase ``name`` (recorded also when it raises, so a failure says how far it got).
        ``beside``: the block runs on a thread of its own while the run's phase of that name goes on (see the
        module docstring)."""
        peak: list[int] = []
        done = threading.Event()
        sampler = None
        if self._reads_memory:
            sampler = threading.Thread(target=self._sample, args=(peak, done), name=f"memory-{name}", daemon=True)
            sampler.start()
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            done.set()
            if sampler is not None:
                sampler.join()
            entry = Phase(name, seconds, max(peak) if peak else None, beside, start)
            with self._lock:
                bisect.insort(self.phases, entry, key=lambda phase: phase.started)

    def _sample(self, peak: list[int], done: threading.Event) -> None:
        self._take(peak)
        while not done.wait(self._interval):
            self._take(peak)
        self._take(peak)  # the phase's end too: a phase shorter than one interval still gets a figure

    def _take(self, peak: list[int]) -> None:
        value = self._memory_in_use()
        if value is not None:
            peak[:] = [max(peak[0], value)] if peak else [value]

    @property
    def seconds(self) -> float:
        """The run's own phases' seconds (those beside them left out: their time is in the phase they ran beside)."""
        return sum(phase.seconds for phase in self.phases if phase.beside is None)

    def as_list(self) -> list[dict]:
        return [phase.as_dict() for phase in self.phases]

    def summary(self) -> str:
        """One line: each phase's seconds (and peak GPU memory where read), then the total of the run's own."""
        parts = []
        for phase in self.phases:
            memory = f" ({phase.peak_bytes / 2**30:.1f} GiB)" if phase.peak_bytes is not None else ""
            parts.append(phase.describe() + memory)
        return " · ".join(parts) + f"; {self.seconds:.1f} s in all"
