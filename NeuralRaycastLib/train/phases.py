"""Where a run's wall clock and GPU memory go, phase by phase: reading the study, its boundary maps, compiling
kernels, the reference views, training and saving. ``fit`` prints the phases when it is done, ``train_log.json``
keeps them and ``bench --suite workstation`` tabulates them, so a slow or hungry step is named, not guessed.
"""

from __future__ import annotations

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

    def as_dict(self) -> dict:
        return {"name": self.name, "seconds": round(self.seconds, 3), "peak_bytes": self.peak_bytes}


class PhaseClock:
    """Times named phases; where ``memory_in_use`` reads the GPU's memory (bytes, or None where it cannot), a
    thread samples it every ``interval`` seconds during each phase, so a phase's peak is the largest sample (a
    short spike between samples can be missed: the figure is a lower bound of the true peak)."""

    def __init__(self, memory_in_use: Callable[[], int | None] | None = None, interval: float = 0.02):
        self.phases: list[Phase] = []
        self._memory_in_use = memory_in_use
        self._interval = interval
        # A device that does not tell its memory is not asked again in every phase.
        self._reads_memory = memory_in_use is not None and memory_in_use() is not None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (recorded also when it raises, so a failure says how far it got)."""
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
            self.phases.append(Phase(name, seconds, max(peak) if peak else None))

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
        return sum(phase.seconds for phase in self.phases)

    def as_list(self) -> list[dict]:
        return [phase.as_dict() for phase in self.phases]

    def summary(self) -> str:
        """One line: each phase's seconds (and peak GPU memory where read), then the total."""
        parts = []
        for phase in self.phases:
            memory = f" ({phase.peak_bytes / 2**30:.1f} GiB)" if phase.peak_bytes is not None else ""
            parts.append(f"{phase.name} {phase.seconds:.1f} s{memory}")
        return " · ".join(parts) + f"; {self.seconds:.1f} s in all"
