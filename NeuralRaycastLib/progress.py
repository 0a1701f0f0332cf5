"""Progress and cancel for long work: the callback types every long job takes, a console bar, and Ctrl-C
as a cancel request."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable

#: ``progress(message, fraction)``: what a long job reports, the fraction done in [0, 1].
Progress = Callable[[str, float], None]
#: ``should_stop()``: polled by a long job between steps; True asks it to stop (keeping what it reached).
ShouldStop = Callable[[], bool]


class Note(str):
    """A progress message to be read whole (work cut down to fit the GPU's memory, a study downsampled): a
    console prints it on a line of its own, where the next message does not replace it."""


class Cancelled(Exception):
    """Long work stopped at its caller's request; the message says what was kept, and where."""


class ConsoleProgress:
    """A ``progress(message, fraction)`` callback that draws ``label [#####     ] 50% message``."""

    def __init__(self, label: str, stream=None, width: int = 30) -> None:
        self.label, self.stream, self.width = label, stream or sys.stderr, width
        self.start = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last_message = None

    def __call__(self, message: str, fraction: float) -> None:
        fraction = min(max(fraction, 0.0), 1.0)
        elapsed = time.perf_counter() - self.start
        if self.tty and isinstance(message, Note):
            self.stream.write(f"\r{self.label}: {message}".ljust(self.width + len(self.label) + 60) + "\n")
        if self.tty:
            filled = int(round(self.width * fraction))
            bar = "#" * filled + " " * (self.width - filled)
            end = "\n" if fraction >= 1.0 else ""
            self.stream.write(f"\r{self.label} [{bar}] {fraction:4.0%} {elapsed:6.1f}s {message[:40]:40s}{end}")
        elif message != self.last_message:
            self.stream.write(f"{self.label}: {fraction:4.0%} {elapsed:6.1f}s {message}\n")
        self.last_message = message
        self.stream.flush()


class CancelOnInterrupt:
    """While active, Ctrl-C asks training to stop at the next step (the state so far is saved);
    a second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self) -> bool:
        return self.requested

    def __enter__(self) -> CancelOnInterrupt:
        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True

        try:
            self._previous = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread: no signal handling
            self._previous = None
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
