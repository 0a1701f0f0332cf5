"""Where slangpy's own messages go: the shader compiler's warnings and notes into a log file in the cache
folder, errors on to Python's logging. A user's terminal (or Slicer's log) then shows only what needs them,
and the compiler's chatter is still there to read when something goes wrong."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from ..paths import cache_folder

LOG_FILE = "slangpy.log"
#: The log is started afresh once it grows past this, so it never fills a disk.
MAX_LOG_BYTES = 8 << 20

_installed: list[Any] = []  # the output slangpy writes to, kept alive while it is installed


def log_path() -> Path:
    return cache_folder("logs") / LOG_FILE


def route_slangpy_messages() -> Path:
    """Send slangpy's messages to :func:`log_path` (errors also to ``logging``), once per process; returns the
    log's path."""
    import slangpy as spy

    path = log_path()
    if _installed:
        return path

    class Routed(spy.LoggerOutput):
        def write(self, level: Any, name: str, msg: str) -> None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                if path.exists() and path.stat().st_size > MAX_LOG_BYTES:
                    path.unlink()
                with path.open("a", encoding="utf-8") as log:
                    log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {level.name.upper()} {name}: {msg}\n")
            except OSError:
                pass  # a log that cannot be written must not stop the work it records
            if level in (spy.LogLevel.error, spy.LogLevel.fatal):
                logging.getLogger("slangpy").error(" ".join(msg.split()))

    output = Routed()
    logger = spy.Logger.get()
    logger.remove_all_outputs()
    logger.add_output(output)
    _installed.append(output)
    return path
