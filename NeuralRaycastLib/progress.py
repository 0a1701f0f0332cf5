"""Console progress for long steps: a bar on a terminal, plain lines otherwise (logs, CI)."""

from __future__ import annotations

import sys
import time


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
        if self.tty:
            filled = int(round(self.width * fraction))
            bar = "#" * filled + " " * (self.width - filled)
            end = "\n" if fraction >= 1.0 else ""
            self.stream.write(f"\r{self.label} [{bar}] {fraction:4.0%} {elapsed:6.1f}s {message[:40]:40s}{end}")
        elif message != self.last_message:
            self.stream.write(f"{self.label}: {fraction:4.0%} {elapsed:6.1f}s {message}\n")
        self.last_message = message
        self.stream.flush()
