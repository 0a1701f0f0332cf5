"""Learned surfaces as label maps (what becomes the Slicer segmentation's binary label map): the finer grid
covers the study's box, and each label map holds the voxels whose centres lie inside its closed mesh."""

from __future__ import annotations

import numpy as np
import pytest

from NeuralRaycastLib.mesh.labelmap import mesh_labelmaps, oversampled_grid, voxelise
from NeuralRaycastLib.mesh.mesh import Mesh, grid_points, mesh_structure
from NeuralRaycastLib.mesh.surface_distance import signed_distance_to_mesh
from NeuralRaycastLib.train.evaluate import dice

#: An oblique (10° about S), anisotropic grid whose i axis runs towards patient left (a mirroring affine).
ANGLE = np.radians(10.0)
ROTATION = np.array([[np.cos(ANGLE), -np.sin(ANGLE), 0], [np.sin(ANGLE), np.cos(ANGLE), 0], [0, 0, 1]])
AFFINE = np.eye(4)
AFFINE[:3, :3] = ROTATION @ np.diag([-1.5, 1.2, 2.0])
AFFINE[:3, 3] = (20.0, -15.0, -12.0)
SHAPE = (24, 28, 16)


def centre() -> np.ndarray:
    return AFFINE[:3, :3] @ (np.array(SHAPE) / 2.0 - 0.5) + AFFINE[:3, 3]


def ellipsoid_sdf(points: np.ndarray, radii=(9.0, 7.0, 6.0), shift=(0.0, 0.0, 0.0)) -> np.ndarray:
    """An ellipsoid's signed distance, approximately (exact sign, scaled by the smallest radius)."""
    scaled = (points - centre() - shift) / np.asarray(radii)
    return (np.linalg.norm(scaled, axis=-1) - 1.0) * min(radii)


def learned_meshes() -> list[Mesh]:
    """Two surfaces of the kind a run yields: marching cubes of a signed distance on the study's grid,
    smoothed as the module's models are."""
    points = grid_points(AFFINE, SHAPE)
    whole = mesh_structure(ellipsoid_sdf(points), AFFINE, "whole_tumor", (0.9, 0.7, 0.2), smoothing_iterations=10)
    core = mesh_structure(ellipsoid_sdf(points, (4.0, 3.5, 3.0), (2.0, 0.0, 1.0)), AFFINE, "tumor_core",
                          (0.8, 0.1, 0.1), smoothing_iterations=10)
    return [whole, core]


def test_the_finer_grid_covers_the_same_box_in_the_same_orientation():
    fine, shape = oversampled_grid(AFFINE, SHAPE, 3)
    assert shape == (72, 84, 48)
    np.testing.assert_allclose(fine[:3, :3], AFFINE[:3, :3] / 3)
    # the outer corner of the first voxel, and the centre of a study voxel as the mean of its 27 fine ones
    corner = np.full(3, -0.5)
    np.testing.assert_allclose(fine[:3, :3] @ corner + fine[:3, 3], AFFINE[:3, :3] @ corner + AFFINE[:3, 3])
    fine_centres = grid_points(fine, shape)[3:6, 6:9, 9:12].reshape(-1, 3).mean(axis=0)
    np.testing.assert_allclose(fine_centres, AFFINE[:3, :3] @ [1, 2, 3] + AFFINE[:3, 3])
    assert oversampled_grid(AFFINE, SHAPE, 1)[1] == SHAPE
    np.testing.assert_allclose(oversampled_grid(AFFINE, SHAPE, 1)[0], AFFINE)
    for bad in (0, 5, 1.5, True):
        with pytest.raises(ValueError, match="oversampling"):
            oversampled_grid(AFFINE, SHAPE, bad)


@pytest.mark.parametrize("oversampling", [1, 2])
def test_each_label_map_holds_the_voxels_inside_its_learned_surface(oversampling):
    meshes = learned_meshes()
    fine, shape, maps = mesh_labelmaps(meshes, AFFINE, SHAPE, oversampling)
    assert [(m.name, m.color) for m in maps] == [(mesh.name, mesh.color) for mesh in meshes]
    points = grid_points(fine, shape)
    for mesh, labelmap in zip(meshes, maps, strict=True):
        mask = labelmap.full(shape)
        # the mesh's interior, by a different route: the signed distance to its triangles at the voxel centres
        box = tuple(slice(max(f - 2, 0), f + n + 2) for f, n in zip(labelmap.first, labelmap.inside.shape,
                                                                     strict=True))
        truth = np.zeros(shape, bool)
        truth[box] = signed_distance_to_mesh(mesh.vertices, mesh.faces, points[box].reshape(-1, 3)
                                             ).reshape(truth[box].shape) < 0
        assert mask.any() and dice(mask, truth) >= 0.99, mesh.name
    # the whole tumour's voxels hold the volume its surface encloses (Segment Statistics reads the label map)
    whole = maps[0].voxels() * abs(np.linalg.det(fine[:3, :3]))
    assert whole == pytest.approx(meshes[0].enclosed_volume(), rel=0.06 / oversampling)


def test_a_finer_label_map_follows_the_surface_more_closely():
    meshes = learned_meshes()[1:]  # the small core: a few voxels across, where the grid matters most
    errors = []
    for oversampling in (1, 2, 4):
        fine, shape, (labelmap,) = mesh_labelmaps(meshes, AFFINE, SHAPE, oversampling)
        volume = labelmap.voxels() * abs(np.linalg.det(fine[:3, :3]))
        errors.append(abs(volume - meshes[0].enclosed_volume()))
    assert errors[2] < errors[0]


def test_an_empty_surface_or_one_off_the_grid_gives_an_empty_label_map():
    assert voxelise(np.zeros((0, 3)), np.zeros((0, 3), int), AFFINE, SHAPE)[1].size == 0
    far = learned_meshes()[0]
    first, inside = voxelise(far.vertices + 1000.0, far.faces, AFFINE, SHAPE)
    assert inside.size == 0 and first == (0, 0, 0)
