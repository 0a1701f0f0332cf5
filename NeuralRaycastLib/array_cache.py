"""Entries of the on-disk caches (studies as read, prepared studies, reference views): a folder of
uncompressed ``.npy`` arrays and a ``meta.json``, written atomically, read without pickle, the least
recently used dropped.

Plain ``.npy`` files load several times faster than the members of an ``.npz`` archive, whose zip reader
copies each array through a buffer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

META = "meta.json"
PARTIAL = ".partial"
#: A partial entry this old was left by a writer that died; it is removed with the stale entries.
ABANDONED_SECONDS = 3600.0


def read_entry(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The arrays and metadata of the entry at ``path``, or None when it is absent or unreadable (the
    caller then computes it again: a damaged entry is never trusted)."""
    if not path.is_dir():
        return None
    try:
        meta = json.loads((path / META).read_text())
        arrays = {name: np.load(path / f"{name}.npy", allow_pickle=False) for name in meta["arrays"]}
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("ignoring unreadable cache entry %s (%s)", path, error)
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: kept longest
    return arrays, meta


def write_entry(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any] | None = None,
                keep: int = 8) -> None:
    """Store an entry at ``path`` (a folder named by the entry's key), replacing any there, then keep the
    ``keep`` most recently used entries beside it. A crash or a second writer never leaves a half-written
    entry; a full or read-only disk costs the next run a recomputation, nothing more."""
    partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}{PARTIAL}")
    try:
        partial.mkdir(parents=True)
        for name, array in arrays.items():
            np.save(partial / f"{name}.npy", np.asanyarray(array), allow_pickle=False)
        (partial / META).write_text(json.dumps({**(meta or {}), "arrays": list(arrays)}))
        if path.exists():
            _remove(path)
        os.replace(partial, path)
    except OSError as error:
        log.warning("could not keep a cache entry in %s: %s", path.parent, error)
    finally:
        _remove(partial)
    drop_stale_entries(path.parent, keep)


def drop_stale_entries(folder: Path, keep: int) -> None:
    """Remove all but the ``keep`` most recently used entries of ``folder`` (files of older formats
    included) and partial entries abandoned by a writer that died."""
    try:
        children = list(folder.iterdir())
        now = time.time()
        partial = [c for c in children if c.name.endswith(PARTIAL)]
        entries = sorted((c for c in children if c not in partial), key=lambda c: c.stat().st_mtime, reverse=True)
        abandoned = [c for c in partial if now - c.stat().st_mtime > ABANDONED_SECONDS]
    except OSError:
        return
    for stale in entries[keep:] + abandoned:
        _remove(stale)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
