"""Whole-volume filters split into slabs along the first axis, one thread each, with the whole call's result bit for
bit: the brain's maps wait for each of them, and a scipy filter runs on one core (it lets other threads run while
it works, so slabs of it run on all of them).

A slab is filtered with the planes the filter reaches on either side (its halo) and only its own planes are kept:
what the filter does at a slab's cut edges stays in the halo, and at the volume's own edges it is the same as on
the whole."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: A slab is at least this many times as thick as its halo, so that the halos do not double the work.
MIN_SLAB_HALOS = 4
#: Nor thinner than this many planes.
MIN_SLAB_PLANES = 8


def slab_edges(planes: int, halo: int) -> np.ndarray:
    """Where the slabs of a volume of ``planes`` planes begin and end (count + 1 edges), one per core at most."""
    thickest = max(MIN_SLAB_HALOS * halo, MIN_SLAB_PLANES)
    count = max(1, min(os.cpu_count() or 1, planes // thickest))
    return np.linspace(0, planes, count + 1).astype(int)


def in_slabs(filter_: Callable[[np.ndarray], np.ndarray], volume: np.ndarray, halo: int,
             dtype: np.dtype | type) -> np.ndarray:
    """``filter_(volume)`` (same shape, of ``dtype``) for a filter that treats every plane along the first axis
    alike and reaches at most ``halo`` planes along it, computed in slabs in threads."""
    edges = slab_edges(volume.shape[0], halo)
    if len(edges) == 2:
        return np.asarray(filter_(volume)).astype(dtype, copy=False)
    out = np.empty(volume.shape, dtype)

    def run(part: int) -> None:
        start, stop = int(edges[part]), int(edges[part + 1])
        low, high = max(start - halo, 0), min(stop + halo, volume.shape[0])
        out[start:stop] = filter_(volume[low:high])[start - low : stop - low]

    with ThreadPoolExecutor(len(edges) - 1) as pool:
        list(pool.map(run, range(len(edges) - 1)))
    return out


def gaussian_reach(sigma: float, truncate: float = 4.0) -> int:
    """How many planes scipy's Gaussian filter of ``sigma`` (voxels) reaches along an axis."""
    return int(truncate * float(sigma) + 0.5)
