"""Distances to a mask's smoothed surface: exact against brute force, no shrinking of smooth shapes, and
small cavities kept where the labels put them."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.ndimage import map_coordinates

from NeuralRaycastLib.mesh.mesh import extract_surface
from NeuralRaycastLib.mesh.surface_distance import (
    balanced_level,
    closest_on_triangles,
    signed_distance_to_mesh,
    smooth_surface,
    vertex_normals,
)
from NeuralRaycastLib.study.preprocess import signed_distance


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


def test_balanced_level_finds_a_tilted_plane_at_any_offset_between_voxel_centres():
    """Voxel centres (1 mm) labelled by a tilted plane at offset ``true``, distances measured to the plane
    moved by ``error``: the balanced level undoes the error; with no labelled point of one side near, it is 0."""
    centres = np.indices((24, 24, 24)).reshape(3, -1).T - 11.5
    normal = np.array([0.31, -0.52, 0.79])
    normal /= np.linalg.norm(normal)
    height = centres @ normal
    for true in (-0.4, -0.1, 0.0, 0.3):
        for error in (-0.3, 0.0, 0.2):
            level = balanced_level(height - (true + error), height < true, voxel=1.0)
            assert level == pytest.approx(-error, abs=0.02), (true, error, level)
    assert balanced_level(height - 0.9, height < 0.0, voxel=1.0) == 0.0  # no inside point within half a voxel
    assert balanced_level(height, np.ones(len(height), bool), voxel=1.0) == 0.0  # one side only


def test_a_small_cavity_keeps_its_place_after_smoothing():
    """A shell (a tumour core around a necrotic cavity 3.5 voxels in radius, 2 mm voxels): smoothing alone
    closes the cavity by about half a millimetre (the boundary map on the exact cavity sphere: 0.49 mm
    on average); moved to agree with the labels, it is within 0.15 voxel there, and within 0.1 voxel on
    the outer sphere."""
    spacing, centre = 2.0, np.array([0.37, -0.21, 0.55])
    n = 12
    affine = np.diag([spacing, spacing, spacing, 1.0])
    affine[:3, 3] = -n * spacing
    points = np.indices((2 * n + 1,) * 3).reshape(3, -1).T * spacing - n * spacing
    radius = np.linalg.norm(points - centre, axis=-1).reshape((2 * n + 1,) * 3)
    shell = (radius < 13.0) & (radius >= 7.0)
    boundary = signed_distance(shell, np.full(3, spacing))
    rng = np.random.default_rng(0)
    directions = rng.normal(size=(500, 3))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    for r, tolerance in ((7.0, 0.15), (13.0, 0.1)):
        on_sphere = centre + r * directions
        ijk = (on_sphere - affine[:3, 3]) / spacing
        values = map_coordinates(boundary, ijk.T, order=1)
        assert np.abs(values).mean() < tolerance * spacing, (r, np.abs(values).mean())


def test_moved_pieces_search_again_the_points_another_piece_came_near():
    """After the pieces of a mesh move by different amounts, the points whose nearest piece may have changed get
    new candidates: every distance is the one a full search on the moved mesh gives, also in the gap between a
    large sphere and a small one that moved towards it."""
    from NeuralRaycastLib.mesh.surface_distance import (
        candidate_triangles,
        candidate_triangles_and_reach,
        candidates_after_move,
        mesh_distances,
        mesh_pieces,
        vertex_normals,
    )

    ijk = np.indices((40, 26, 26)).reshape(3, -1).T.astype(np.float64)
    large = np.linalg.norm(ijk - [13.0, 13.0, 13.0], axis=-1) - 9.0
    small = np.linalg.norm(ijk - [29.0, 13.0, 13.0], axis=-1) - 3.6  # 3.4 voxels of gap between them
    field = np.minimum(large, small).reshape(40, 26, 26).astype(np.float32)
    vertices, faces = extract_surface(field, np.eye(4))
    pieces = mesh_pieces(len(vertices), faces)
    assert pieces.max() == 1
    points = ijk[np.abs(field.ravel()) <= 3.0]
    nearest, reach = candidate_triangles_and_reach(vertices, faces, points)
    normals = vertex_normals(vertices, faces)
    small_piece = pieces[np.argmax(vertices[:, 0])]
    moved = vertices + np.where(pieces == small_piece, 1.5, 0.2)[:, None] * normals  # the small one grows most
    kept = candidates_after_move(vertices, moved, faces, points, nearest, reach, pieces)
    searched = (kept != nearest).any(axis=1)
    gap = (points[:, 0] > 22) & (points[:, 0] < 26) & (np.abs(points[:, 1] - 13) < 2) & (np.abs(points[:, 2] - 13) < 2)
    assert searched[gap].all() and not searched.all()  # the gap searched again, not every point
    full = mesh_distances(moved, faces, points, candidate_triangles(moved, faces, points))[0]
    np.testing.assert_allclose(mesh_distances(moved, faces, points, kept)[0], full, atol=1e-9)


def test_vertex_normals_point_straight_out_of_a_sphere():
    """The normals a smoothed piece is moved along (agree_with_labels): each vertex's area-weighted mean of its
    faces' normals, unit length, along the sphere's radius outwards."""
    vertices, faces = sphere_mesh(6.0)
    normals = vertex_normals(vertices, faces)
    radial = vertices - 0.3
    radial /= np.linalg.norm(radial, axis=1, keepdims=True)
    np.testing.assert_allclose(np.linalg.norm(normals, axis=1), 1.0, atol=1e-12)
    assert (normals * radial).sum(axis=1).min() > 0.99


def test_the_distance_floor_is_below_every_points_distance_and_rules_out_the_far_points():
    """mesh_distance_floor: what the boundary maps use to measure first only the points that may lie within a
    voxel of the smoothed surface. It must never exceed a point's true distance (brute force over every triangle
    of a terraced, smoothed sphere), and it must rule out the points well away from the surface."""
    from NeuralRaycastLib.mesh.surface_distance import candidate_search, candidate_triangles, mesh_distance_floor

    vertices, faces = sphere_mesh(6.0, voxelised=True)
    vertices = smooth_surface(vertices, faces)
    points = np.random.default_rng(1).uniform(-10, 10, (600, 3))
    corners = vertices[faces]
    _, distance2, _ = closest_on_triangles(points[:, None, :], corners[None, :, 0], corners[None, :, 1],
                                           corners[None, :, 2])
    brute = np.sqrt(distance2.min(axis=1))
    nearest, centroid_distances = candidate_search(vertices, faces, points)
    floor = mesh_distance_floor(vertices, faces, centroid_distances[:, 0])
    assert np.all(floor <= brute + 1e-12)
    assert np.all(floor[brute > 2.5] > 1.0)  # a triangle of a 1-voxel grid spreads less than 1.5 voxels
    np.testing.assert_array_equal(nearest, candidate_triangles(vertices, faces, points))


@pytest.mark.parametrize("library", ["pykdtree", "scipy"])
def test_nearest_neighbours_are_exact_with_either_library(library, monkeypatch):
    """The candidate triangles' search (pykdtree's tree, or scipy's where pykdtree is not installed) finds each
    point's k nearest centroids, nearest first, at the distances a brute-force search measures."""
    import sys

    from NeuralRaycastLib.mesh.surface_distance import nearest_neighbours

    if library == "pykdtree":
        pytest.importorskip("pykdtree.kdtree")
    else:
        monkeypatch.setitem(sys.modules, "pykdtree.kdtree", None)  # import pykdtree.kdtree raises ImportError
    vertices, faces = sphere_mesh(5.0, voxelised=True)
    centroids = smooth_surface(vertices, faces)[faces].mean(axis=1)
    points = np.random.default_rng(2).uniform(-8, 8, (300, 3))
    distances, indices = nearest_neighbours(centroids, points, 12)
    assert distances.shape == indices.shape == (300, 12) and indices.dtype == np.int64
    brute = np.linalg.norm(points[:, None] - centroids[None], axis=-1)
    np.testing.assert_allclose(distances, np.sort(brute, axis=1)[:, :12], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.take_along_axis(brute, indices, axis=1), distances, rtol=1e-12, atol=1e-12)
    single = nearest_neighbours(centroids, points[:1], 1)
    assert single[0].shape == single[1].shape == (1, 1) and single[1][0, 0] == indices[0, 0]
    assert nearest_neighbours(centroids, points[:0], 12)[1].shape == (0, 12)


def test_smoothing_the_coordinates_together_is_smoothing_each_alone():
    """The three coordinates go through each sparse product together; each comes out bit for bit as the filter
    gives it alone, so the smoothed surfaces (and the boundary maps) do not depend on how they are batched."""
    vertices, faces = sphere_mesh(5.0, spacing=0.8, voxelised=True)
    together = smooth_surface(vertices, faces)
    for axis in range(3):
        np.testing.assert_array_equal(together[:, [axis]], smooth_surface(vertices[:, [axis]], faces))
