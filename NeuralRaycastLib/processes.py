"""Child processes that end with everything they started: the training worker the Slicer module runs
(app/worker.py) and a cohort's study processes (cohort/local_gpus.py) each start in a process group of their
own, are ended with that group, and a crash is named the same way for both.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Any


def own_group() -> dict[str, Any]:
    """``subprocess.Popen`` options that start a child in a process group of its own (so that it can be ended
    with every process it starts; on Windows, without a console window of its own)."""
    if os.name == "nt":
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP | getattr(subprocess, "CREATE_NO_WINDOW", 0)}
    return {"start_new_session": True}


def kill_tree(process: subprocess.Popen) -> None:
    """End a child started with :func:`own_group` and everything in its group (SIGKILL; taskkill /T on
    Windows); nothing where it has ended."""
    if os.name == "nt":
        if process.poll() is None:
            subprocess.run(["taskkill", "/F", "/T", "/PID", str(process.pid)], capture_output=True, check=False)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def describe_exit(status: int) -> str:
    """How a process ended, from its return code: ``signal SIGKILL``, ``exit status 1``."""
    if status < 0:
        try:
            return f"signal {signal.Signals(-status).name}"
        except ValueError:
            return f"signal {-status}"
    return f"exit status {status}"
