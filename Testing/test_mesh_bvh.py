"""Meshes of signed distance grids and ray queries through the BVH, checked against exact answers."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import analytic_prepared
from scipy import ndimage

from NeuralRaycastLib.mesh.bvh import BvhTracer, build_bvh
from NeuralRaycastLib.mesh.mesh import (
    EXPORT_FORMATS,
    Mesh,
    coarsened_grid,
    grid_points,
    mesh_prepared,
    mesh_structure,
    read_mesh_polydata,
    refined_grid,
    resample_sdf,
    write_mesh,
    write_meshes,
)
from NeuralRaycastLib.render.mesh_shadows import MeshShadows
from NeuralRaycastLib.study.preprocess import prepare
from NeuralRaycastLib.study.sample.phantom import sphere_sdf
from NeuralRaycastLib.study.study import load_study

CENTRE, RADIUS = np.array([1.3, -0.7, 0.4]), 10.0


def sphere_mesh(affine: np.ndarray, shape, centre=CENTRE, radius=RADIUS, name="sphere", **options) -> Mesh:
    volume = sphere_sdf(grid_points(affine, shape), centre, radius).astype(np.float32)
    return mesh_structure(volume, affine, name, (0.2, 0.4, 0.6), **options)


def mirrored(affine: np.ndarray, shape) -> np.ndarray:
    """The same grid with the i axis reversed: a left-handed IJK→RAS (as many NIfTI files have)."""
    flipped = np.array(affine, float)
    flipped[:3, 3] += flipped[:3, 0] * (shape[0] - 1)
    flipped[:3, 0] *= -1
    return flipped


def assert_outward(mesh: Mesh, centre: np.ndarray) -> None:
    radial = mesh.vertices - centre
    radial /= np.linalg.norm(radial, axis=1, keepdims=True)
    assert np.einsum("ij,ij->i", mesh.normals, radial).min() > 0.999
    face_centre = mesh.vertices[mesh.faces].mean(axis=1) - centre
    assert (np.einsum("ij,ij->i", mesh.face_normals(), face_centre) > 0).all()
    assert mesh.enclosed_volume() > 0


def assert_closed(mesh: Mesh) -> None:
    """Every edge is shared by exactly two triangles, traversed in opposite directions."""
    edges = np.concatenate([mesh.faces[:, [0, 1]], mesh.faces[:, [1, 2]], mesh.faces[:, [2, 0]]])
    assert len(np.unique(edges, axis=0)) == len(edges)  # no directed edge twice: consistent winding
    undirected, counts = np.unique(np.sort(edges, axis=1), axis=0, return_counts=True)
    assert (counts == 2).all() and len(undirected) == len(edges) // 2


# ---- meshes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("handedness", ["right", "left"])
def test_sphere_mesh_at_twice_the_resolution_lies_within_a_tenth_of_a_voxel(handedness):
    coarse = analytic_prepared({"sphere": lambda p: sphere_sdf(p, CENTRE, RADIUS)}, 2.0, (-14, -14, -14), (14, 14, 14))
    affine = coarse.affine if handedness == "right" else mirrored(coarse.affine, coarse.study.shape)
    assert np.linalg.det(affine[:3, :3]) * (1 if handedness == "right" else -1) > 0
    fine_affine, fine_shape = refined_grid(affine, coarse.study.shape, 2)
    voxel = 1.0
    np.testing.assert_allclose(np.linalg.norm(fine_affine[:3, :3], axis=0), voxel)
    sdf = resample_sdf(lambda p: sphere_sdf(p, CENTRE, RADIUS), fine_affine, fine_shape)
    assert sdf.shape == (1, *fine_shape)
    mesh = mesh_structure(sdf[0], fine_affine, "sphere", (1.0, 0.0, 0.0))
    error = np.abs(np.linalg.norm(mesh.vertices - CENTRE, axis=1) - RADIUS)
    assert len(mesh.vertices) > 1000 and error.max() < 0.1 * voxel
    assert_outward(mesh, CENTRE)
    assert_closed(mesh)
    assert mesh.enclosed_volume() == pytest.approx(4 / 3 * np.pi * RADIUS**3, rel=0.01)


def test_coarsened_grid_holds_every_nth_voxel_centre():
    affine = np.array([[-1.5, 0, 0, 20.0], [0, 1.2, 0, -30.0], [0, 0, 2.0, 5.0], [0, 0, 0, 1]])
    shape = (7, 6, 5)
    coarse_affine, coarse_shape = coarsened_grid(affine, shape, 2)
    assert coarse_shape == (4, 3, 3)
    np.testing.assert_allclose(grid_points(coarse_affine, coarse_shape), grid_points(affine, shape)[::2, ::2, ::2])


def test_resampling_evaluates_every_voxel_centre_in_order_in_chunks():
    affine = np.array([[0.0, -1.5, 0.3, 20.0], [1.2, 0.0, 0.0, -30.0], [0.2, 0.4, 2.0, 5.0], [0, 0, 0, 1]])
    shape = (7, 6, 5)
    calls = []

    def sdf(points):
        calls.append(len(points))
        return np.stack([points @ [1.0, 10.0, 100.0], -points[:, 0]], axis=1)

    grid = resample_sdf(sdf, affine, shape, chunk=70)  # two slices of 30 points per call
    points = grid_points(affine, shape)
    np.testing.assert_allclose(grid[0], points @ [1.0, 10.0, 100.0], rtol=1e-6, atol=1e-3)
    np.testing.assert_allclose(grid[1], -points[..., 0], rtol=1e-6, atol=1e-4)
    assert calls == [60, 60, 60, 30]


@pytest.mark.parametrize("volume", ["smooth", "zero on voxels", "integers"])
def test_marching_cubes_gives_each_vertex_once_and_uses_it(volume):
    """The welding the exports rely on, with and without vertices on voxel centres (where marching cubes can
    repeat a vertex: it does on the integer grid); shadow meshes without normals have the same triangles."""
    if volume == "smooth":
        grid = ndimage.gaussian_filter(np.random.default_rng(3).normal(size=(24, 24, 24)), 3)
        grid = (grid - grid.mean()).astype(np.float32)
    elif volume == "zero on voxels":  # a sphere of radius 5 centred on a voxel
        offsets = np.indices((21, 21, 21)).astype(np.float32) - 10
        grid = (np.sqrt((offsets**2).sum(axis=0)) - 5).astype(np.float32)
    else:
        grid = np.random.default_rng(0).integers(-1, 2, size=(12, 12, 12)).astype(np.float32)
    affine = np.diag([1.0, 1.5, 2.0, 1.0])
    mesh = mesh_structure(grid, affine, "s", (1.0, 0.0, 0.0))
    if volume == "integers":  # the same triangles, by their corners' positions, as marching cubes gave
        from skimage.measure import marching_cubes

        raw, raw_faces, _, _ = marching_cubes(np.pad(grid, 1, constant_values=1.0), 0.0, allow_degenerate=False)
        assert len(np.unique(raw, axis=0)) < len(raw)  # it did repeat vertices
        corners = (raw - 1.0) * np.diag(affine)[:3]

        def triangles(points, faces):
            return Counter(tuple(sorted(map(tuple, np.round(points[f], 4)))) for f in faces)

        expected = Counter({t: n for t, n in triangles(corners, raw_faces).items() if len(set(t)) == 3})
        assert triangles(mesh.vertices, mesh.faces) == expected
    assert len(np.unique(mesh.vertices, axis=0)) == len(mesh.vertices)
    assert np.array_equal(np.unique(mesh.faces), np.arange(len(mesh.vertices)))
    assert np.all((mesh.faces[:, 0] != mesh.faces[:, 1]) & (mesh.faces[:, 1] != mesh.faces[:, 2])
                  & (mesh.faces[:, 0] != mesh.faces[:, 2]))
    assert mesh.normals.shape == mesh.vertices.shape
    bare = mesh_structure(grid, affine, "s", (1.0, 0.0, 0.0), normals=False)
    assert bare.normals.shape == (0, 3)
    np.testing.assert_array_equal(bare.vertices, mesh.vertices)
    np.testing.assert_array_equal(bare.faces, mesh.faces)


def test_smoothing_and_decimation_keep_the_surface_and_its_orientation():
    affine = np.eye(4)
    affine[:3, 3] = -14
    plain = sphere_mesh(affine, (29, 29, 29))
    smoothed = sphere_mesh(affine, (29, 29, 29), smoothing_iterations=20)
    decimated = sphere_mesh(affine, (29, 29, 29), decimation=0.5)
    assert len(decimated.faces) == pytest.approx(0.5 * len(plain.faces), rel=0.05)
    for mesh in (smoothed, decimated):
        assert_outward(mesh, CENTRE)
        assert_closed(mesh)
        error = np.abs(np.linalg.norm(mesh.vertices - CENTRE, axis=1) - RADIUS)
        assert error.max() < 0.15
        assert mesh.enclosed_volume() == pytest.approx(plain.enclosed_volume(), rel=0.02)


@pytest.mark.parametrize("kind", EXPORT_FORMATS)
def test_each_export_format_reads_back_with_the_same_points_and_cells(tmp_path, kind):
    affine = np.eye(4)
    affine[:3, 3] = -14
    mesh = sphere_mesh(affine, (29, 29, 29), name="whole_tumor")
    path = write_mesh(mesh, tmp_path / f"{mesh.name}.{kind}")
    polydata = read_mesh_polydata(path)
    assert polydata.GetNumberOfPoints() == len(mesh.vertices)
    assert polydata.GetNumberOfCells() == len(mesh.faces)
    if kind == "vtp":
        fields = polydata.GetFieldData()
        assert fields.GetAbstractArray("Name").GetValue(0) == "whole_tumor"
        np.testing.assert_allclose(fields.GetArray("Color").GetTuple3(0), mesh.color, atol=1e-6)
        normals = np.array([polydata.GetPointData().GetNormals().GetTuple3(i) for i in range(5)])
        np.testing.assert_allclose(normals, mesh.normals[:5], atol=1e-6)


def test_phantom_study_meshes_carry_the_structures_names_and_colours(phantom_study_dir, tmp_path):
    prepared = prepare(load_study(phantom_study_dir), cache_root=tmp_path)
    meshes = mesh_prepared(prepared)
    assert [m.name for m in meshes] == [s.name for s in prepared.structures]
    assert [m.color for m in meshes] == [tuple(s.color) for s in prepared.structures]
    for index, mesh in enumerate(meshes):
        assert len(mesh.faces) > 100, mesh.name
        assert_closed(mesh)
        assert mesh.enclosed_volume() > 0
        # vertices lie on the zero level of the boundary map they came from (to trilinear accuracy)
        ijk = (mesh.vertices - prepared.affine[:3, 3]) @ np.linalg.inv(prepared.affine[:3, :3]).T
        values = ndimage.map_coordinates(prepared.boundary[index], ijk.T, order=1)
        assert np.abs(values).max() < 0.25 * float(prepared.spacing.min()), mesh.name
    paths = write_meshes(meshes, tmp_path / "meshes", EXPORT_FORMATS)
    assert sorted(p.name for p in paths) == sorted(f"{m.name}.{kind}" for m in meshes for kind in EXPORT_FORMATS)
    brain = read_mesh_polydata(tmp_path / "meshes" / "brain.vtp")
    assert brain.GetFieldData().GetAbstractArray("Name").GetValue(0) == "brain"


# ---- BVH ------------------------------------------------------------------------------------------


def random_soup(count: int, seed: int) -> Mesh:
    rng = np.random.default_rng(seed)
    centres = rng.uniform(-20, 20, (count, 1, 3))
    vertices = (centres + rng.normal(0, 2.5, (count, 3, 3))).reshape(-1, 3)
    faces = np.arange(3 * count).reshape(-1, 3)
    return Mesh(vertices, faces, np.zeros_like(vertices), "soup", (1.0, 1.0, 1.0))


def test_bvh_nodes_bound_their_triangles_and_hold_each_triangle_once():
    soup = random_soup(700, seed=3)
    bvh = build_bvh(soup, leaf_size=4)
    assert np.array_equal(np.sort(bvh.triangle_ids), np.arange(700))
    np.testing.assert_array_equal(bvh.corners, soup.vertices[soup.faces][bvh.triangle_ids].astype(np.float32))
    leaves = bvh.is_leaf()
    first, count = bvh.links[leaves, 0], -bvh.links[leaves, 1]
    assert (count >= 1).all() and (count <= 4).all() and count.sum() == 700
    for node, start, n in zip(np.flatnonzero(leaves), first, count, strict=True):
        triangles = bvh.corners[start : start + n].reshape(-1, 3)
        assert (triangles >= bvh.box_min[node]).all() and (triangles <= bvh.box_max[node]).all()
    inner = np.flatnonzero(~leaves)
    for side in (0, 1):
        child = bvh.links[inner, side]
        assert (child > inner).all()
        assert (bvh.box_min[child] >= bvh.box_min[inner]).all() and (bvh.box_max[child] <= bvh.box_max[inner]).all()
    assert len(inner) == len(np.flatnonzero(leaves)) - 1  # a binary tree


def brute_force(origins, directions, t_max, triangles):
    """Exact (float64) Möller–Trumbore against every triangle: (closest t or inf, its triangle, ambiguous).

    A ray is ambiguous where float32 rounding could change the answer: it passes within a relative 1e-4
    of a triangle's edge, meets a triangle at nearly tMax or nearly edge-on, or two hits nearly tie.
    """
    a, b, c = (triangles[None, :, i] for i in range(3))
    e1, e2 = b - a, c - a
    d = directions[:, None]
    p = np.cross(d, e2)
    det = np.einsum("rtk,rtk->rt", np.broadcast_to(e1, p.shape), p)
    s = origins[:, None] - a
    q = np.cross(s, e1)
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.einsum("rtk,rtk->rt", s, p) / det
        v = np.einsum("rtk,rtk->rt", np.broadcast_to(d, q.shape), q) / det
        t = np.einsum("rtk,rtk->rt", np.broadcast_to(e2, q.shape), q) / det
    w = 1.0 - u - v
    inside = (u >= 0) & (v >= 0) & (w >= 0)
    hits = inside & (t > 0) & (t < t_max[:, None])
    margin = 1e-4
    near_edge = (np.minimum(np.minimum(u, v), w) > -margin) & (np.abs(np.minimum(np.minimum(u, v), w)) < margin)
    cos = np.abs(det) / (np.linalg.norm(np.cross(e1, e2), axis=-1) * np.linalg.norm(d, axis=-1))
    in_range = (t > -margin) & (t < t_max[:, None] * (1 + margin))
    ambiguous = (near_edge & in_range) | (inside & in_range & (np.abs(t - t_max[:, None]) < margin * t_max[:, None]))
    ambiguous |= inside & in_range & (cos < 1e-3)
    times = np.where(hits, t, np.inf)
    order = np.sort(times, axis=1)
    with np.errstate(invalid="ignore"):  # inf - inf where a ray hits nothing
        ties = np.isfinite(order[:, 1]) & (order[:, 1] - order[:, 0] < margin * order[:, 0])
    return order[:, 0], np.argmin(times, axis=1), ambiguous.any(axis=1) | ties


@pytest.mark.parametrize("scene", ["soup", "sphere"])
def test_closest_and_any_hit_agree_with_brute_force(gpu, scene):
    rng = np.random.default_rng(7)
    if scene == "soup":
        mesh = random_soup(400, seed=11)
    else:
        affine = np.eye(4)
        affine[:3, 3] = -14
        mesh = sphere_mesh(affine, (29, 29, 29))
    tracer = BvhTracer(gpu, build_bvh(mesh))
    count = 3000
    origins = rng.uniform(-25, 25, (count, 3))
    targets = rng.uniform(-12, 12, (count, 3))  # aimed at the scene, so about half of the rays hit
    directions = (targets - origins) / rng.uniform(5.0, 40.0, (count, 1))  # not unit length
    t_max = np.where(rng.random(count) < 0.5, 1e30, rng.uniform(1.0, 30.0, count))
    exact_t, exact_triangle, ambiguous = brute_force(origins, directions, t_max, mesh.vertices[mesh.faces])
    clear = ~ambiguous
    assert clear.mean() > 0.95, clear.mean()

    hits = tracer.closest(origins, directions, t_max)
    exact_hit = np.isfinite(exact_t)
    assert 0.2 < exact_hit[clear].mean() < 0.8, exact_hit[clear].mean()
    assert np.array_equal(hits.hit[clear], exact_hit[clear])
    both = clear & exact_hit
    assert np.array_equal(hits.triangle[both], exact_triangle[both])
    np.testing.assert_allclose(hits.t[both], exact_t[both], rtol=1e-4)
    assert (hits.mesh[both] == 0).all() and (hits.mesh[~hits.hit] == -1).all()
    u, v = hits.barycentric[both].T
    corners = mesh.vertices[mesh.faces[hits.triangle[both]]]
    point = (1 - u - v)[:, None] * corners[:, 0] + u[:, None] * corners[:, 1] + v[:, None] * corners[:, 2]
    np.testing.assert_allclose(point, origins[both] + hits.t[both, None] * directions[both], atol=1e-3)

    occluded = tracer.occluded(origins, directions, t_max)
    assert np.array_equal(occluded[clear], exact_hit[clear])


@pytest.mark.parametrize("through_grid", [True, False], ids=["light grid", "bvh"])
def test_mesh_shadows_are_exact_where_a_sphere_shades_another(gpu, through_grid):
    """Key light straight above; a small sphere over a large one shadows a disc on the large one's top."""
    affine = np.eye(4)
    affine[:3, 3] = -30
    big_centre, small_centre, big, small = np.array([0.3, -0.2, 0.1]), np.array([0.3, -0.2, 26.1]), 15.0, 5.0
    meshes = [
        sphere_mesh(affine, (61, 61, 61), big_centre, big, "big"),
        sphere_mesh(affine, (61, 61, 61), small_centre, small, "small"),
    ]
    bvh = build_bvh(meshes)
    points, normals = meshes[0].vertices, meshes[0].normals
    radial = np.linalg.norm(points[:, :2] - big_centre[:2], axis=1)
    top = points[:, 2] > big_centre[2] + 1.0
    under, beside = top & (radial < small - 0.5), top & (radial > small + 0.5)
    assert under.sum() > 20 and beside.sum() > 20

    opaque = MeshShadows(gpu, bvh)
    visibility = opaque.key_visibility(points, normals, (0.0, 0.0, 1.0), through_grid)
    assert (visibility[under] == 0).all() and (visibility[beside] == 1).all()

    translucent = MeshShadows(gpu, bvh, opacities=[0.3, 0.6])
    visibility = translucent.key_visibility(points, normals, (0.0, 0.0, 1.0), through_grid)
    np.testing.assert_allclose(visibility[under], 0.4**2, rtol=1e-6)  # in and out of the small sphere
    np.testing.assert_allclose(visibility[beside], 1.0)
    bottom = points[:, 2] < big_centre[2] - 1.0
    np.testing.assert_allclose(visibility[bottom & (radial > small + 0.5)], 0.7, rtol=1e-6)  # own far wall

    ambient = opaque.ambient_visibility(points, normals)
    assert np.array_equal(ambient, opaque.ambient_visibility(points, normals))  # deterministic
    assert ((ambient >= 0) & (ambient <= 1)).all()
    far = radial > big - 1.0  # at the equator nothing but the sphere's own (convex) surface is near
    assert ambient[far].mean() > 0.99
    assert ambient[under].mean() < 0.9


@pytest.mark.parametrize("scene", ["soup", "spheres"])
def test_the_light_grid_crosses_the_same_triangles_as_the_bvh(gpu, scene):
    """The renderer's shadow rays go through a grid of the triangles as the key light sees them: for any light
    direction the same translucent transmittance as rays through the BVH, point by point."""
    rng = np.random.default_rng(3)
    if scene == "soup":
        meshes = [random_soup(400, seed=12), random_soup(300, seed=13)]
    else:
        affine = np.eye(4)
        affine[:3, 3] = -30
        meshes = [sphere_mesh(affine, (61, 61, 61), np.array([0.3, -0.2, 0.1]), 15.0, "big"),
                  sphere_mesh(affine, (61, 61, 61), np.array([2.0, 1.0, 20.0]), 6.0, "small")]
    shadows = MeshShadows(gpu, build_bvh(meshes), opacities=[0.3, 0.6])
    points = rng.uniform(-20, 20, (4000, 3))
    normals = rng.normal(size=(4000, 3))
    normals /= np.linalg.norm(normals, axis=1, keepdims=True)
    for to_light in ((0.0, 0.0, 1.0), (0.45, 0.35, 0.82), tuple(rng.normal(size=3))):
        grid = shadows.key_visibility(points, normals, to_light)
        bvh = shadows.key_visibility(points, normals, to_light, through_grid=False)
        assert (bvh < 1.0).mean() > 0.2  # the rays do cross the meshes
        np.testing.assert_allclose(grid, bvh, rtol=1e-6, atol=1e-6)
