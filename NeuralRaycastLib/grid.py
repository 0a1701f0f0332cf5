"""Voxel grids: where a grid's corners lie, whether two grids are the same, trilinear sampling, and a cell grid's
corners against its cells."""

from __future__ import annotations

import numpy as np

#: Two grids of the same shape are the same where their corners lie within this many of the reference's
#: smallest voxel side (headers written by different tools round their affines differently).
GRID_TOLERANCE_VOXELS = 0.1


def grid_corners(affine: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """RAS coordinates of the 8 corner voxel centres, shape (8, 3)."""
    idx = np.array([[i, j, k, 1.0] for i in (0, shape[0] - 1) for j in (0, shape[1] - 1) for k in (0, shape[2] - 1)])
    return (idx @ np.asarray(affine).T)[:, :3]


def grid_corners_bounds(affine: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    corners = grid_corners(affine, shape)
    return np.stack([corners.min(axis=0), corners.max(axis=0)])


def interpolate_ijk(volume: np.ndarray, ijk: np.ndarray) -> np.ndarray:
    """Trilinear interpolation of a volume (I, J, K), or of a stack of them (S, I, J, K), at voxel
    coordinates (N, 3); outside the grid the edge values continue. Shape (N,) or (S, N).

    The same numbers as ``scipy.ndimage.map_coordinates(order=1, mode="nearest")``, in numpy alone (so
    starting a training run does not load scipy) and one gather per corner for a whole stack."""
    shape = np.array(volume.shape[-3:])
    ijk = np.clip(np.asarray(ijk, np.float64), 0, shape - 1)
    base = np.minimum(np.floor(ijk).astype(np.intp), np.maximum(shape - 2, 0))
    upper = ijk - base  # the weights of the upper corners per axis; 1 - upper those of the lower ones
    lower = 1.0 - upper
    flat = volume.reshape(*volume.shape[:-3], -1)
    strides = np.array([shape[1] * shape[2], shape[2], 1])
    steps = np.where(shape > 1, strides, 0)  # a one-voxel axis has no upper corner
    first = base @ strides
    result = np.zeros((*volume.shape[:-3], len(ijk)))
    for a in (0, 1):
        wa = (upper if a else lower)[:, 0]
        for b in (0, 1):
            wab = wa * (upper if b else lower)[:, 1]
            for c in (0, 1):
                index = first + (a * steps[0] + b * steps[1] + c * steps[2])
                result += (wab * (upper if c else lower)[:, 2]) * np.take(flat, index, axis=-1)
    return result


def sample_at(volume: np.ndarray, affine: np.ndarray, points: np.ndarray) -> np.ndarray:
    """A volume (or a stack of them, see :func:`interpolate_ijk`) trilinearly at RAS points (N, 3)."""
    ras_to_ijk = np.linalg.inv(np.asarray(affine, np.float64))
    return interpolate_ijk(volume, np.asarray(points) @ ras_to_ijk[:3, :3].T + ras_to_ijk[:3, 3])


def voxel_ml(affine: np.ndarray) -> float:
    """One voxel's volume in millilitres (|det| of the affine's linear part, so sheared grids count right)."""
    return abs(float(np.linalg.det(np.asarray(affine, np.float64)[:3, :3]))) / 1000.0


def off_grid_mm(affine: np.ndarray, reference_affine: np.ndarray, shape: tuple[int, ...]) -> float | None:
    """How far (mm, the largest corner displacement) a grid of ``shape`` (IJK) lies off the reference grid of
    the same shape, where that is more than :data:`GRID_TOLERANCE_VOXELS`; None where both are one grid.
    The one check the study loaders and the Slicer module both apply."""
    offset = float(np.abs(grid_corners(affine, shape) - grid_corners(reference_affine, shape)).max())
    tolerance = GRID_TOLERANCE_VOXELS * float(np.linalg.norm(np.asarray(reference_affine)[:3, :3], axis=0).min())
    return offset if offset > tolerance else None


def voxel_box(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first and last index along each axis of a non-empty mask's voxels (both inside the box)."""
    spans = [np.flatnonzero(mask.any(axis=tuple(other for other in range(3) if other != axis))) for axis in range(3)]
    return np.array([span[0] for span in spans]), np.array([span[-1] for span in spans])


def voxel_box_slices(mask: np.ndarray) -> tuple[slice, ...]:
    """A non-empty mask's bounding box as slices of its grid."""
    low, high = voxel_box(mask)
    return tuple(slice(int(lo), int(hi) + 1) for lo, hi in zip(low, high, strict=True))


def least_corner(corners: np.ndarray) -> np.ndarray:
    """Each cell's least value over its eight corners: values at a cell grid's corners (Z + 1, Y + 1, X + 1) to one a
    cell (Z, Y, X). A cell's corners are its two ends along each axis in turn, so the least of them is taken one axis
    at a time: three passes over the grid instead of eight (the occupancy grid and the latent bricks take it on a
    grid of millions of corners while a fit waits). NaN where a corner is NaN, as numpy's minimum."""
    least = np.minimum(corners[:-1], corners[1:])
    least = np.minimum(least[:, :-1], least[:, 1:])
    return np.minimum(least[:, :, :-1], least[:, :, 1:])


def marked_corners(cells: np.ndarray) -> np.ndarray:
    """The corners (Z + 1, Y + 1, X + 1) of the marked cells (Z, Y, X, bool): every corner of each, one axis at a
    time as :func:`least_corner`."""
    marked = np.asarray(cells, bool)
    for axis in range(3):
        shape = list(marked.shape)
        shape[axis] += 1
        spread = np.zeros(shape, bool)
        before = tuple(slice(0, -1) if a == axis else slice(None) for a in range(3))
        after = tuple(slice(1, None) if a == axis else slice(None) for a in range(3))
        spread[before] = marked
        spread[after] |= marked
        marked = spread
    return marked
