"""A grid of shadow-mesh triangles as the key light sees them (shaders/light_grid.slang).

Every key-light shadow ray runs along the light's direction, so it projects onto the plane across that
direction as one point, and only triangles whose projection holds that point can be crossed. The grid
bins each triangle by its projected bounds (widened a little, so rounding never leaves out one the exact
3D test would hit); a ray then tests the triangles of its cell alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..mesh.bvh import Bvh

MAX_CELLS_PER_AXIS = 4096
PAD_MM = 1e-3  # projected bounds are widened by this (plus a relative 1e-6) before binning


@dataclass
class LightGrid:
    cell_start: np.ndarray  # (cells + 1,) int32: first entry of each cell, u fastest
    entries: np.ndarray  # (E,) int32: triangles in the BVH's leaf order
    axis_u: np.ndarray  # (3,) unit vectors across the light
    axis_v: np.ndarray
    origin: np.ndarray  # (2,) (u, v) of cell (0, 0)'s corner, mm
    cell_mm: float
    dims: tuple[int, int]  # cells along u and v


def across(direction: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two unit vectors perpendicular to ``direction`` and to each other."""
    w = np.asarray(direction, np.float64)
    w = w / np.linalg.norm(w)
    helper = np.eye(3)[int(np.argmin(np.abs(w)))]
    u = np.cross(w, helper)
    u /= np.linalg.norm(u)
    return u, np.cross(w, u)


def build_light_grid(bvh: Bvh, to_light, cell_mm: float | None = None) -> LightGrid:
    """Bin ``bvh``'s triangles for rays along ``to_light``. ``cell_mm`` defaults to half the median projected
    extent of a triangle: on the sample's meshes a non-empty cell then holds about half as many triangles as
    with cells of the whole extent, at twice the entries."""
    axis_u, axis_v = across(to_light)
    corners = bvh.corners.reshape(-1, 3, 3).astype(np.float64)
    a, b, c = (corners[:, i] @ np.stack([axis_u, axis_v], axis=1) for i in range(3))  # (T, 2) each
    low, high = np.minimum(np.minimum(a, b), c), np.maximum(np.maximum(a, b), c)
    pad = PAD_MM + 1e-6 * np.maximum(np.abs(low), np.abs(high))
    low, high = low - pad, high + pad
    if len(low) == 0:
        return LightGrid(np.zeros(2, np.int32), np.zeros(0, np.int32), axis_u, axis_v, np.zeros(2), 1.0, (1, 1))
    origin = low.min(axis=0)
    extent = high.max(axis=0) - origin
    if cell_mm is None:
        cell_mm = 0.5 * float(np.median((high - low).max(axis=1)))
    cell_mm = max(cell_mm, float(extent.max()) / MAX_CELLS_PER_AXIS, 1e-3)
    dims = np.maximum(np.ceil(extent / cell_mm).astype(np.int64), 1)
    first = np.clip(np.floor((low - origin) / cell_mm).astype(np.int64), 0, dims - 1)
    last = np.clip(np.floor((high - origin) / cell_mm).astype(np.int64), 0, dims - 1)
    span = last - first + 1  # (T, 2) cells along u and v
    counts = span[:, 0] * span[:, 1]
    triangle = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    k = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    width = span[triangle, 0]
    cu = first[triangle, 0] + k % width
    cv = first[triangle, 1] + k // width
    cell = cv * dims[0] + cu
    order = np.argsort(cell, kind="stable")
    cell_start = np.zeros(int(dims[0] * dims[1]) + 1, np.int64)
    np.cumsum(np.bincount(cell, minlength=int(dims[0] * dims[1])), out=cell_start[1:])
    return LightGrid(cell_start.astype(np.int32), triangle[order].astype(np.int32), axis_u, axis_v, origin,
                     cell_mm, (int(dims[0]), int(dims[1])))


def light_grid_struct(gpu, grid: LightGrid) -> tuple[list, dict]:
    """Upload a grid: (the tensors, which must stay alive while it is used; the ``LightGrid`` shader struct)."""
    import slangpy as spy

    tensors = [spy.Tensor.from_numpy(gpu.device, np.ascontiguousarray(a, np.int32))
               for a in (grid.cell_start, grid.entries if len(grid.entries) else np.zeros(1, np.int32))]
    struct = {
        "cellStart": tensors[0].storage.device_address,
        "entries": tensors[1].storage.device_address,
        "axisU": spy.float3(*map(float, grid.axis_u)),
        "axisV": spy.float3(*map(float, grid.axis_v)),
        "origin": spy.float2(*map(float, grid.origin)),
        "cellInv": float(1.0 / grid.cell_mm),
        "dims": spy.int2(*grid.dims),
    }
    return tensors, struct
