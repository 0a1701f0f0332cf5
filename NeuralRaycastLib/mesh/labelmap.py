"""Learned surfaces as label maps: each closed mesh voxelised on the study's grid or a finer one.

What Slicer's Segment Editor, Segment Statistics and export work on is a binary label map per segment; the
learned surfaces are sub-voxel, so they are voxelised on the study's grid split ``oversampling`` times along
each axis (the same box, the same orientation). A voxel is inside where its centre is inside the closed mesh:
VTK's polygon-to-stencil scan, the one Slicer's own closed-surface to label map conversion uses, run in the
grid's index space so that any orientation and spacing work. Only each mesh's box is scanned and kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..grid import voxel_ml

#: The largest oversampling offered: a study voxel split into 4 x 4 x 4 already holds 64 label voxels.
MAX_OVERSAMPLING = 4


def oversampled_grid(affine: np.ndarray, shape: Sequence[int], factor: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """The grid whose voxels split each of the grid's into ``factor`` along every axis: the same outer box
    (voxel faces), the same orientation; ``factor`` 1 is the grid itself."""
    if isinstance(factor, bool) or not isinstance(factor, (int, np.integer)) or not 1 <= factor <= MAX_OVERSAMPLING:
        raise ValueError(f"the oversampling must be a whole number from 1 to {MAX_OVERSAMPLING} (got {factor!r})")
    affine = np.asarray(affine, np.float64)
    fine = affine.copy()
    fine[:3, :3] = affine[:3, :3] / factor
    fine[:3, 3] = affine[:3, 3] + affine[:3, :3] @ np.full(3, -(factor - 1) / (2.0 * factor))
    return fine, tuple(int(n) * int(factor) for n in shape)


@dataclass
class StructureLabelmap:
    """One structure's voxels on a grid, kept on the box around them: ``inside`` (I, J, K) starts at grid
    index ``first``."""

    name: str
    color: tuple[float, float, float]
    first: tuple[int, int, int]
    inside: np.ndarray  # bool (I, J, K) over the box

    def voxels(self) -> int:
        return int(self.inside.sum())

    def full(self, shape: Sequence[int]) -> np.ndarray:
        """The mask over the whole grid of ``shape``."""
        mask = np.zeros(tuple(shape), bool)
        i, j, k = self.first
        ni, nj, nk = self.inside.shape
        mask[i:i + ni, j:j + nj, k:k + nk] = self.inside
        return mask


def voxelise(vertices: np.ndarray, faces: np.ndarray, affine: np.ndarray, shape: Sequence[int]
             ) -> tuple[tuple[int, int, int], np.ndarray]:
    """The voxels of a grid whose centres lie inside a closed triangle mesh (RAS mm): (first index, bool
    (I, J, K) mask over the box around the mesh, clipped to the grid). Empty ((0, 0, 0) shaped) where the mesh
    has no triangles or lies outside the grid."""
    import vtk
    from vtk.util.numpy_support import vtk_to_numpy

    from .mesh import _polydata

    shape = np.asarray(shape, int)
    empty = ((0, 0, 0), np.zeros((0, 0, 0), bool))
    if len(faces) == 0:
        return empty
    ras_to_ijk = np.linalg.inv(np.asarray(affine, np.float64))
    ijk = np.asarray(vertices, np.float64) @ ras_to_ijk[:3, :3].T + ras_to_ijk[:3, 3]
    low = np.maximum(np.floor(ijk.min(axis=0)).astype(int), 0)
    high = np.minimum(np.ceil(ijk.max(axis=0)).astype(int), shape - 1)
    if np.any(high < low):
        return empty
    stencil = vtk.vtkPolyDataToImageStencil()
    stencil.SetInputData(_polydata(ijk, faces))
    stencil.SetOutputOrigin(0.0, 0.0, 0.0)
    stencil.SetOutputSpacing(1.0, 1.0, 1.0)
    stencil.SetOutputWholeExtent(int(low[0]), int(high[0]), int(low[1]), int(high[1]), int(low[2]), int(high[2]))
    image = vtk.vtkImageStencilToImage()
    image.SetInputConnection(stencil.GetOutputPort())
    image.SetInsideValue(1)
    image.SetOutsideValue(0)
    image.SetOutputScalarTypeToUnsignedChar()
    image.Update()
    counts = high - low + 1
    values = vtk_to_numpy(image.GetOutput().GetPointData().GetScalars())
    inside = values.reshape(counts[2], counts[1], counts[0]).transpose(2, 1, 0) != 0  # VTK's x runs fastest
    return (int(low[0]), int(low[1]), int(low[2])), np.ascontiguousarray(inside)


def mesh_labelmaps(meshes, affine: np.ndarray, shape: Sequence[int], oversampling: int = 1
                   ) -> tuple[np.ndarray, tuple[int, ...], list[StructureLabelmap]]:
    """Each mesh (``mesh.Mesh``: closed, RAS mm) voxelised on the grid ``oversampling`` times finer than
    (affine, shape): (the finer grid's affine, its shape, one label map per mesh, in the meshes' order)."""
    fine, fine_shape = oversampled_grid(affine, shape, oversampling)
    maps = []
    for mesh in meshes:
        first, inside = voxelise(mesh.vertices, mesh.faces, fine, fine_shape)
        maps.append(StructureLabelmap(mesh.name, tuple(float(c) for c in mesh.color), first, inside))
    return fine, fine_shape, maps


def labelmap_volume_ml(labelmap: StructureLabelmap, affine: np.ndarray) -> float:
    """The volume of a label map's voxels on the grid of ``affine``, in millilitres."""
    return labelmap.voxels() * voxel_ml(affine)
