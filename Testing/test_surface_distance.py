"""Distances to a mask's smoothed surface: exact against brute force, and no shrinking of smooth shapes."""

from __future__ import annotations

import numpy as np

from NeuralRaycastLib.mesh import extract_surface
from NeuralRaycastLib.surface_distance import closest_on_triangles, signed_distance_to_mesh, smooth_surface


def sphere_mesh(radius: float, spacing: float = 1.0, voxelised: bool = False):
    """Marching cubes of a sphere's exact distances, or of its voxel mask (terraced)."""
    n = int(np.ceil(radius / spacing)) + 3
    affine = np.diag([spacing, spacing, spacing, 1.0])
    affine[:3, 3] = -n * spacing
    ijk = np.indices((2 * n + 1,) * 3).reshape(3, -1).T
    points = ijk * spacing - n * spacing
    field = (np.linalg.norm(points - 0.3 * spacing, axis=-1) - radius).reshape((2 * n + 1,) * 3)
    if voxelised:
        field = 0.5 - (field < 0)
    return extract_surface(field.astype(np.float32), affine)


def test_signed_distance_to_mesh_matches_brute_force_and_is_negative_inside():
    vertices, faces = sphere_mesh(6.0)
    rng = np.random.default_rng(0)
    points = rng.uniform(-9, 9, (400, 3))
    corners = vertices[faces]
    _, distance2, _ = closest_on_triangles(points[:, None, :], corners[None, :, 0], corners[None, :, 1],
                                           corners[None, :, 2])
    brute = np.sqrt(distance2.min(axis=1))
    fast = signed_distance_to_mesh(vertices, faces, points)
    np.testing.assert_allclose(np.abs(fast), brute, atol=1e-9)
    radius = np.linalg.norm(points - 0.3, axis=-1)
    clear = np.abs(radius - 6.0) > 0.2  # away from the facets, the sign is the exact sphere's
    assert np.all((fast[clear] < 0) == (radius[clear] < 6.0))


def test_closest_point_on_a_triangle_covers_face_edge_and_corner():
    a, b, c = np.array([0.0, 0, 0]), np.array([1.0, 0, 0]), np.array([0.0, 1, 0])
    points = np.array([[0.2, 0.2, 1.0], [0.5, -1.0, 0.0], [-1.0, -1.0, 0.0]])
    closest, distance2, normal = closest_on_triangles(points, a, b, c)
    np.testing.assert_allclose(closest, [[0.2, 0.2, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    np.testing.assert_allclose(distance2, [1.0, 1.0, 2.0])
    np.testing.assert_allclose(normal, [0.0, 0.0, 1.0])


def test_smoothing_removes_terraces_without_shrinking_a_sphere():
    vertices, faces = sphere_mesh(8.0, voxelised=True)
    before = np.linalg.norm(vertices - 0.3, axis=-1) - 8.0
    after = np.linalg.norm(smooth_surface(vertices, faces) - 0.3, axis=-1) - 8.0
    assert np.abs(after).mean() < 0.5 * np.abs(before).mean()
    assert abs(after.mean()) < 0.05  # voxels: no net shrinkage
