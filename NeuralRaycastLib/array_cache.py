"""Entries of the on-disk caches (studies as read, prepared studies, reference views): a folder of
uncompressed ``.npy`` arrays and a ``meta.json``, written atomically, read without pickle, the least
recently used dropped.

Plain ``.npy`` files load several times faster than the members of an ``.npz`` archive, whose zip reader
copies each array through a buffer.

An entry can be written behind (:func:`write_entry_behind`): on a thread of its own while its caller goes on. This
process's reads of it and the cache's clearing wait for it, and the process finishes it before it exits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

META = "meta.json"
PARTIAL = ".partial"
#: A partial entry this old was left by a writer that died; it is removed with the stale entries.
ABANDONED_SECONDS = 3600.0


#: The thread entries are written behind on, and the entries it has yet to finish, by folder.
_WRITER = ThreadPoolExecutor(1, thread_name_prefix="cache-writer")
_WRITING: dict[Path, Future] = {}
_WRITING_LOCK = threading.Lock()
os.register_at_fork(after_in_child=_WRITING.clear)  # a forked child has no writer: it waits for none


def read_entry(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The arrays and metadata of the entry at ``path`` (once written, where it is being written behind), or
    None when it is absent or unreadable (the caller then computes it again: a damaged entry is never
    trusted)."""
    with _WRITING_LOCK:
        writing = _WRITING.get(path)
    if writing is not None:
        wait([writing])
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


def write_entry_behind(path: Path, arrays: Callable[[], dict[str, np.ndarray]], meta: dict[str, Any] | None = None,
                       keep: int = 8) -> None:
    """:func:`write_entry` on the cache's own thread, with the arrays ``arrays()`` gives there (copies for the
    cache, say, made off the caller's way): the caller goes on at once and must not change what they read."""

    def written(future: Future) -> None:  # its arrays are let go; an error write_entry does not expect is said
        with _WRITING_LOCK:
            if _WRITING.get(path) is future:
                del _WRITING[path]
        if future.exception() is not None:
            log.warning("could not keep a cache entry in %s: %s", path.parent, future.exception())

    with _WRITING_LOCK:
        _WRITING[path] = future = _WRITER.submit(lambda: write_entry(path, arrays(), meta, keep))
    future.add_done_callback(written)


def finish_writes() -> None:
    """Wait until every entry written behind (:func:`write_entry_behind`) is written."""
    with _WRITING_LOCK:
        writing = list(_WRITING.values())
    wait(writing)


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
