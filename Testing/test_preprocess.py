"""Boundary maps against the phantom's exact distances, normalisation, masks, P(x), occupancy, cache."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from scipy import ndimage

from NeuralRaycastLib.array_cache import finish_writes
from NeuralRaycastLib.study import preprocess
from NeuralRaycastLib.study.preprocess import (
    EXACT_BAND_VOXELS,
    EXACT_REACH_MM,
    SURFACE_SMOOTHING_ITERATIONS,
    SURFACE_SMOOTHING_PASSBAND,
    as_float16,
    derived_probability,
    fill_holes,
    head_mask,
    mask_bounds,
    normalise_channel,
    occupancy_grid,
    prepare,
    signed_distance,
    structure_mask,
)
from NeuralRaycastLib.study.sample.phantom import Phantom, voxel_centres
from NeuralRaycastLib.study.structures import BRAIN, make_structures
from NeuralRaycastLib.study.study import Study, load_study


@pytest.fixture(scope="module")
def phantom_prepared(phantom_study_dir, tmp_path_factory):
    return prepare(load_study(phantom_study_dir), cache_root=tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("name", Phantom.structure_names)
def test_boundary_maps_match_exact_distances_near_each_surface(phantom_prepared, name):
    """Mean |B - exact| within 3 voxels of the surface is at most half a voxel."""
    voxel = float(phantom_prepared.spacing.min())
    points = voxel_centres(phantom_prepared.affine, phantom_prepared.study.shape)
    exact = Phantom().sdf(name, points)
    estimate = phantom_prepared.boundary[phantom_prepared.structure_index(name)]
    band = np.abs(exact) < 3 * voxel
    assert band.sum() > 100
    error = np.abs(estimate[band] - exact[band])
    assert error.mean() <= 0.5 * voxel, f"{name}: mean error {error.mean():.3f} mm"
    clear = band & (np.abs(exact) > voxel)  # a voxel or more from the surface the sign must be right
    assert np.all(np.sign(estimate[clear]) == np.sign(exact[clear]))  # negative inside


@pytest.mark.parametrize("name", Phantom.structure_names)
def test_boundary_map_normals_follow_the_exact_surface(phantom_prepared, name):
    """Normals from ∇B (what the renderer shades with) are within a few degrees of the exact ones."""
    spacing = phantom_prepared.spacing
    points = voxel_centres(phantom_prepared.affine, phantom_prepared.study.shape)
    exact = Phantom().sdf(name, points)
    estimate = phantom_prepared.boundary[phantom_prepared.structure_index(name)]
    near = np.abs(exact) < spacing.min()
    g_exact = np.stack(np.gradient(exact, *spacing), axis=-1)[near]
    g_estimate = np.stack(np.gradient(estimate, *spacing), axis=-1)[near]
    cosine = (g_exact * g_estimate).sum(-1) / np.linalg.norm(g_exact, axis=-1) / np.linalg.norm(g_estimate, axis=-1)
    assert np.degrees(np.arccos(np.clip(cosine, -1, 1))).mean() < 5.0


def test_signed_distance_respects_anisotropic_spacing():
    spacing = np.array([0.8, 1.0, 2.5])
    shape = (80, 64, 28)
    affine = np.diag([*spacing, 1.0])
    affine[:3, 3] = -0.5 * (np.array(shape) - 1) * spacing
    points = voxel_centres(affine, shape)
    exact = np.linalg.norm(points, axis=-1) - 20.0
    estimate = signed_distance(exact < 0, spacing)
    band = np.abs(exact) < 3 * spacing.max()
    assert np.abs(estimate[band] - exact[band]).mean() <= 0.5 * spacing.min()
    # Far from the sphere the distance must be metric, not in voxels: compare along the coarse axis.
    far = np.abs(exact) > 5
    assert np.abs(estimate[far] - exact[far]).mean() < 0.5 * spacing.max()


def test_signed_distance_keeps_a_voxelised_sphere_where_it_was():
    """The zero level of B lies closer to a voxelised sphere's true surface than marching cubes on the
    mask does (at least twice), with no inward shift (a Gaussian on the distance map moves it by σ²/R)."""
    from NeuralRaycastLib.mesh.mesh import extract_surface

    spacing = np.array([1.0, 1.0, 1.0])
    affine = np.eye(4)
    affine[:3, 3] = -15.0
    centre = np.array([0.31, -0.22, 0.17])  # off the voxel lattice
    radius = 7.3
    points = voxel_centres(affine, (31, 31, 31))
    inside = np.linalg.norm(points - centre, axis=-1) < radius

    def errors(volume):
        vertices, faces = extract_surface(volume.astype(np.float32), affine)
        return np.linalg.norm(vertices - centre, axis=-1) - radius

    boundary = errors(signed_distance(inside, spacing))
    label_map = errors(0.5 - inside.astype(np.float32))
    assert np.abs(boundary).mean() <= 0.5 * np.abs(label_map).mean()
    assert abs(boundary.mean()) < 0.05  # voxels


def whole_grid_signed_distance(inside: np.ndarray, spacing: np.ndarray) -> np.ndarray:
    """The boundary map as :func:`signed_distance` defines it, taken the plain way: both transforms over the
    whole grid, a nearest-centroid search for every point, each piece's point the nearest vertex's, and a
    second search after the pieces move."""
    from NeuralRaycastLib.mesh.mesh import extract_surface
    from NeuralRaycastLib.mesh.surface_distance import agree_with_labels, signed_distance_to_mesh, smooth_surface

    half = 0.5 * spacing.min()
    sdf = np.where(inside, -(ndimage.distance_transform_edt(inside, sampling=spacing) - half),
                   ndimage.distance_transform_edt(~inside, sampling=spacing) - half)
    vertices, faces = extract_surface(0.5 - inside.astype(np.float32), np.diag([*spacing, 1.0]))
    vertices = smooth_surface(vertices, faces, SURFACE_SMOOTHING_ITERATIONS, SURFACE_SMOOTHING_PASSBAND)
    band = np.abs(sdf) <= EXACT_BAND_VOXELS * spacing.max()
    points = np.argwhere(band) * spacing
    exact = signed_distance_to_mesh(vertices, faces, points)
    moved = agree_with_labels(vertices, faces, points, inside[band], exact, float(spacing.min()))
    exact = signed_distance_to_mesh(moved, faces, points)
    trusted = (np.sign(exact) == np.sign(sdf[band])) | (np.abs(sdf[band]) < spacing.max())
    sdf[band] = np.where(trusted, exact, sdf[band])
    return sdf


@pytest.mark.parametrize("shape_name", ["shell", "shell against the grid's edge", "slit ring"])
def test_cropped_boundary_map_matches_the_whole_grid_one(shape_name):
    """The map taken over the structure's box alone, with one search for nearest triangles where the
    smoothed surface is one piece (what makes it fast), equals the whole-grid one near the surface and within
    EXACT_REACH_MM of the structure, to a micrometre; further out it is a lower bound of it, never below that
    reach, and the sign is the same everywhere. A shell is two pieces (one a small cavity); a ring with a
    narrow slit is one piece whose two faces of the slit are equally near the points in it."""
    spacing = np.array([1.5, 2.0, 2.5])
    shape = (72, 50, 44)
    centre = np.array([30.3, 4.0 if "edge" in shape_name else 40.2, 50.1])
    points = (np.indices(shape).reshape(3, -1).T * spacing).reshape(*shape, 3)
    radius = np.linalg.norm(points - centre, axis=-1)
    if shape_name == "slit ring":
        across = np.linalg.norm((points - centre)[..., :2], axis=-1)
        slit = (np.abs(points[..., 1] - centre[1]) < 1.7) & (points[..., 0] > centre[0])
        inside = (across < 14.0) & (across >= 5.0) & (np.abs(points[..., 2] - centre[2]) < 6.0) & ~slit
    else:
        inside = (radius < 13.0) & (radius >= 6.5)
    reference = whole_grid_signed_distance(inside, spacing)
    fast = signed_distance(inside, spacing)
    assert fast.dtype == np.float32
    near = np.abs(reference) <= EXACT_REACH_MM
    far = ~near
    assert far.sum() > 0.5 * far.size  # the crop leaves most of the grid to the far field
    band = np.abs(reference) <= EXACT_BAND_VOXELS * spacing.max()
    np.testing.assert_allclose(fast[band], reference[band], atol=1e-4)
    np.testing.assert_allclose(fast[near], reference[near], atol=1e-4)
    np.testing.assert_array_equal(np.sign(fast), np.sign(reference))
    assert np.all(fast[far] <= reference[far] + 1e-4)  # never further than it is: safe to step by
    assert np.all(fast[far] >= EXACT_REACH_MM - 0.5 * spacing.min() - 1e-4)


def test_prepared_maps_are_each_structures_own_in_structure_order(tiny_brats):
    """The structures are computed in threads at once: each map is its own structure's, as computed alone
    and rounded as the cache keeps it."""
    study = load_study(tiny_brats)
    prepared = prepare(study, use_cache=False)
    assert [s.name for s in prepared.structures] == ["brain", "whole_tumor", "tumor_core", "enhancing_tumor"]
    for index, structure in enumerate(prepared.structures):
        alone = signed_distance(structure_mask(structure, study.labels, prepared.mask), study.spacing)
        np.testing.assert_array_equal(prepared.boundary[index], alone.astype(np.float16).astype(np.float32),
                                      err_msg=structure.name)


def test_signed_distance_refuses_empty_mask():
    with pytest.raises(ValueError, match="mask is empty"):
        signed_distance(np.zeros((4, 4, 4), bool), np.ones(3))


def test_a_given_brain_mask_is_used_instead_of_thresholding(tmp_path):
    rng = np.random.default_rng(0)
    image = rng.random((24, 24, 24)).astype(np.float32)  # nothing a threshold could find a brain in
    brain = np.zeros(image.shape, bool)
    brain[4:20, 5:19, 6:18] = True
    labels = np.zeros(image.shape, np.int16)
    labels[10:13, 10:13, 10:13] = 2
    labels[2:4, 10:12, 10:12] = 2  # labelled outside the given mask: still part of the brain
    prepared = prepare(Study.from_arrays({"t1": image}, np.eye(4), labels=labels, brain_mask=brain),
                       cache_root=tmp_path)
    np.testing.assert_array_equal(prepared.mask, brain | (labels > 0))
    brain_map = prepared.boundary[prepared.structure_index("brain")]
    assert np.all(brain_map[ndimage.binary_erosion(prepared.mask)] < 0)
    assert np.all(brain_map[~ndimage.binary_dilation(prepared.mask)] > 0)


def test_normalisation_maps_percentiles_and_ignores_outliers_and_background():
    rng = np.random.default_rng(0)
    image = np.zeros((40, 40, 40), np.float32)
    mask = np.zeros(image.shape, bool)
    mask[5:35, 5:35, 5:35] = True
    image[mask] = rng.uniform(100, 200, mask.sum())
    normalised = normalise_channel(image, mask)
    assert np.percentile(normalised[mask], 0.5) == pytest.approx(0.0, abs=1e-4)
    assert np.percentile(normalised[mask], 99.5) == pytest.approx(1.0, abs=1e-4)
    spiked = image.copy()
    spiked[10, 10, 10:14] = 1e6  # a few hot voxels must not squash the rest
    np.testing.assert_allclose(normalise_channel(spiked, mask)[mask][:1000], normalised[mask][:1000], atol=1e-3)


def test_head_mask_finds_the_phantom_brain(phantom_prepared):
    points = voxel_centres(phantom_prepared.affine, phantom_prepared.study.shape)
    exact = Phantom().sdf("brain", points) < 0
    mask = head_mask(phantom_prepared.study.channels)
    dice = 2 * (mask & exact).sum() / (mask.sum() + exact.sum())
    assert dice > 0.97


@pytest.mark.parametrize("library", ["edt", "scipy"])
def test_distance_transform_is_exact_in_mm_with_either_library(library, monkeypatch):
    """The boundary maps' transform (edt on all cores, or scipy where edt is not installed) gives every voxel
    its exact anisotropic distance to the nearest voxel outside ``outside``, in float32."""
    import sys

    from NeuralRaycastLib.study.preprocess import _distance_transform

    if library == "edt":
        pytest.importorskip("edt")
    else:
        monkeypatch.setitem(sys.modules, "edt", None)  # import edt raises ImportError
    spacing = np.array([0.5, 0.7, 3.0])
    outside = np.ones((23, 17, 9), bool)
    seeds = np.array([[3, 4, 1], [18, 12, 7], [0, 16, 8]])
    outside[tuple(seeds.T)] = False
    grid = np.stack(np.meshgrid(*map(np.arange, outside.shape), indexing="ij"), axis=-1)
    exact = np.min([np.linalg.norm((grid - seed) * spacing, axis=-1) for seed in seeds], axis=0)
    distance = _distance_transform(outside, spacing)
    assert distance.dtype == np.float32
    np.testing.assert_allclose(distance, exact, rtol=1e-6, atol=1e-5)


def test_head_mask_on_its_box_is_the_whole_grids():
    """Closing, filling and choosing the largest piece on the box around the thresholded voxels gives the mask
    the whole grid gives, also where the head touches the grid's faces."""
    from skimage.filters import threshold_otsu

    rng = np.random.default_rng(7)
    for shape, centre in (((40, 36, 30), (20, 18, 15)), ((40, 36, 30), (3, 30, 26))):
        points = np.stack(np.meshgrid(*map(np.arange, shape), indexing="ij"), axis=-1)
        radius = np.linalg.norm(points - centre, axis=-1)
        image = (radius < 11).astype(np.float32)
        image += 0.6 * rng.random(shape, np.float32) * (radius < 13)  # specks, gaps and a ragged edge
        image[33:36, 4:7, 4:7] = 1.5  # a second piece, smaller
        image = np.asfortranarray(image)  # as NIfTI data comes
        whole = image / np.percentile(image, 99.0) > threshold_otsu(image / np.percentile(image, 99.0))
        whole = ndimage.binary_closing(whole, structure=ndimage.generate_binary_structure(3, 1), iterations=2)
        whole = ndimage.binary_fill_holes(whole)
        components, _ = ndimage.label(whole)
        sizes = np.bincount(components.ravel())
        sizes[0] = 0
        whole = components == int(np.argmax(sizes))
        np.testing.assert_array_equal(head_mask({"t1": image}), whole)


def test_filters_in_slabs_are_the_whole_volumes(monkeypatch):
    """The Gaussian, closing and boundary of the maps' steps, split into slabs along the first axis (one a core),
    give the whole volume's result bit for bit, at the volume's faces too; so do a mask's voxels and values."""
    from NeuralRaycastLib.study import slabs

    monkeypatch.setattr(slabs.os, "cpu_count", lambda: 7)
    rng = np.random.default_rng(3)
    values = ndimage.gaussian_filter(rng.standard_normal((61, 17, 13)), 2.0).astype(np.float32)
    inside = values > 0
    face = ndimage.generate_binary_structure(3, 1)
    cases = [
        (lambda v: ndimage.gaussian_filter(v, 0.8, mode="nearest"), values, slabs.gaussian_reach(0.8)),
        (lambda v: ndimage.gaussian_filter(v, (1.3, 0.9, 2.1), mode="nearest"), values, slabs.gaussian_reach(1.3)),
        (lambda m: ndimage.binary_closing(m, structure=face, iterations=2), inside, 4),
        (lambda m: ndimage.binary_dilation(m) & ~ndimage.binary_erosion(m), inside, 1),
    ]
    for filter_, volume, halo in cases:
        assert len(slabs.slab_edges(len(volume), halo)) > 3  # several slabs
        np.testing.assert_array_equal(slabs.in_slabs(filter_, volume, halo, volume.dtype), filter_(volume))
    np.testing.assert_array_equal(preprocess._voxels_of(inside), np.argwhere(inside))  # the band's points
    np.testing.assert_array_equal(preprocess._in_band(values, inside), values[inside])  # and values
    written, expected = values.copy(), values.copy()
    expected[inside] = -values[inside]
    preprocess._set_in_band(written, inside, -values[inside])
    np.testing.assert_array_equal(written, expected)


def test_otsu_threshold_is_scikit_images(monkeypatch):
    """The brain mask's threshold, its histogram counted in parts, is scikit-image's, in Fortran order as NIfTI data
    comes, in double precision and on a flat image."""
    from skimage.filters import threshold_otsu

    monkeypatch.setattr(preprocess.os, "cpu_count", lambda: 5)
    rng = np.random.default_rng(11)
    image = np.asfortranarray(rng.gamma(2.0, 100.0, (40, 30, 20)).astype(np.float32))
    for values in (image, image.astype(np.float64) / 7.0, np.full((4, 4, 4), 3.0, np.float32)):
        assert preprocess._otsu_threshold(values) == threshold_otsu(values.ravel(order="K"))


def test_a_thresholded_brain_is_taken_as_tidy_only_where_tidying_changes_nothing():
    """The thresholded head is one piece without holes, so its tidying is skipped; labels that add a piece
    outside it (or could enclose a hole) have it tidied."""
    from NeuralRaycastLib.study.drawn_labels import LabelNote, tidy_label

    shape = (40, 36, 30)
    radius = np.linalg.norm(np.stack(np.meshgrid(*map(np.arange, shape), indexing="ij"), axis=-1) - (20, 18, 15),
                            axis=-1)
    image = np.where((radius < 11) & (radius > 4), 1.0, 0.0).astype(np.float32)  # a hollow ball
    image[33:36, 4:7, 4:7] = 1.0  # and a speck apart
    labels = np.zeros(shape, np.int16)
    labels[18:22, 8:11, 14:16] = 1  # inside the head
    for given, tidy in ((None, True), (labels, True)):
        study = Study.from_arrays({"t1": image}, np.eye(4), labels=given)
        mask, known_tidy = preprocess._brain_mask_and_tidiness(study)
        assert known_tidy == tidy
        tidied, apart, note = tidy_label(mask, study.affine)
        np.testing.assert_array_equal(tidied, mask)
        assert apart is None and note == LabelNote()
    outside = labels.copy()
    outside[1:3, 1:3, 1:3] = 2  # a label piece outside the head
    study = Study.from_arrays({"t1": image}, np.eye(4), labels=outside)
    mask, known_tidy = preprocess._brain_mask_and_tidiness(study)
    assert not known_tidy
    assert tidy_label(mask, study.affine)[2].left_out  # it would be left out
    given = Study.from_arrays({"t1": image}, np.eye(4), brain_mask=radius < 11)
    assert not preprocess._brain_mask_and_tidiness(given)[1]


def test_fill_holes_is_scipys_on_masks_with_holes_tunnels_and_faces():
    """Cavities are filled, also one that meets a tunnel to the grid's faces only at a corner (face
    connectivity keeps them apart); tunnels and what touches a face stay open; a full and an empty mask stay
    as they are."""
    rng = np.random.default_rng(4)
    noisy = ndimage.binary_opening(rng.random((30, 26, 22)) < 0.55)
    shell = np.zeros((16, 16, 16), bool)
    shell[2:14, 2:14, 2:14] = True
    shell[4:7, 4:7, 4:7] = False  # a cavity
    shell[7:10, 7:10, 7:10] = False  # another, meeting the tunnel below only at a corner
    shell[5, 10:, 5] = False  # tunnels to a face
    shell[10, 10, 10:] = False
    for mask in (noisy, shell, np.ones((5, 6, 7), bool), np.zeros((5, 6, 7), bool)):
        np.testing.assert_array_equal(fill_holes(mask), ndimage.binary_fill_holes(mask))
    assert fill_holes(shell)[5, 5, 5] and fill_holes(shell)[8, 8, 8] and not fill_holes(shell)[5, 12, 5]


def test_derived_probability_is_a_smooth_step_across_the_whole_tumour(phantom_prepared):
    p = phantom_prepared.probability
    whole = phantom_prepared.boundary[phantom_prepared.structure_index("whole_tumor")]
    width = float(phantom_prepared.spacing.mean())  # one voxel
    assert p[whole < -3 * width].min() > 0.95
    assert p[whole > 3 * width].max() < 0.05
    assert 0.3 < p[np.abs(whole) < 0.2].mean() < 0.7
    assert derived_probability(np.zeros(3, np.float32), 1.0) == pytest.approx(0.5)


def test_given_probability_is_kept():
    rng = np.random.default_rng(3)
    image = rng.random((12, 12, 12)).astype(np.float32)
    labels = np.zeros((12, 12, 12), np.int16)
    labels[4:8, 4:8, 4:8] = 2
    probability = rng.random((12, 12, 12)).astype(np.float32)
    study = Study.from_arrays({"t1": image}, np.eye(4), labels=labels, probability=probability)
    np.testing.assert_allclose(prepare(study, use_cache=False).probability, probability, atol=1e-3)


def test_occupancy_and_bounds_cover_the_mask(phantom_prepared):
    prepared = phantom_prepared
    block = prepared.occupancy_block
    for i, j, k in np.argwhere(prepared.mask)[::97]:
        assert prepared.occupancy[i // block, j // block, k // block]
    assert prepared.occupancy.mean() < 1.0  # something is empty
    ijk = np.argwhere(prepared.mask).astype(float)
    ras = ijk @ prepared.affine[:3, :3].T + prepared.affine[:3, 3]
    assert np.all(ras >= prepared.bounds[0]) and np.all(ras <= prepared.bounds[1])
    assert occupancy_grid(np.ones((9, 9, 9), bool), block=8).shape == (2, 2, 2)


def test_occupancy_and_bounds_on_the_masks_box_are_the_whole_grids():
    """The occupancy grid (the mask dilated by a voxel, in blocks) and the RAS box taken on the mask's box are
    those of the whole grid, also for a mask on the grid's faces, a block's edge, or a single voxel."""
    affine = np.array([[0.0, -0.9, 0.0, 30.0], [1.1, 0.0, 0.0, -20.0], [0.0, 0.0, 2.5, 5.0], [0.0, 0.0, 0.0, 1.0]])
    masks = [np.zeros((29, 20, 17), bool) for _ in range(3)]
    masks[0][9:14, 3:8, 7:8] = True  # ends at a block's edge, so its dilation spills into the next block
    masks[1][0:4, 15:20, 16] = True  # on the grid's faces
    masks[2][8, 16, 0] = True  # one voxel
    for mask in masks:
        dilated = ndimage.binary_dilation(mask)
        padded = np.pad(dilated, [(0, (-n) % 8) for n in mask.shape])
        blocks = padded.reshape(padded.shape[0] // 8, 8, padded.shape[1] // 8, 8, padded.shape[2] // 8, 8)
        np.testing.assert_array_equal(occupancy_grid(mask, block=8), blocks.any(axis=(1, 3, 5)))
        ijk = np.argwhere(mask)
        corners = np.array([[*(ijk.min(0) - 0.5 + (ijk.max(0) - ijk.min(0) + 1) * np.array(c)), 1.0]
                            for c in np.ndindex(2, 2, 2)])
        ras = (corners @ affine.T)[:, :3]
        np.testing.assert_allclose(mask_bounds(mask, affine), [ras.min(0) - 2.0, ras.max(0) + 2.0])


def test_cache_gives_identical_maps_and_survives_a_damaged_file(phantom_study_dir, tmp_path):
    study = load_study(phantom_study_dir)
    computed = []  # before_maps: where the maps are computed, not where the cache gives them (a run readies for them)
    first = prepare(study, cache_root=tmp_path, before_maps=lambda: computed.append("first"))
    finish_writes()  # the entry is written behind
    (cached,) = tmp_path.iterdir()
    second = prepare(study, cache_root=tmp_path, before_maps=lambda: computed.append("second"))
    assert computed == ["first"]
    np.testing.assert_array_equal(first.boundary, second.boundary)
    np.testing.assert_array_equal(first.probability, second.probability)
    for name in ("channels", "mask", "occupancy", "bounds"):  # the cached grid and box are those derived anew
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name), err_msg=name)
    # the channels' normalisation ranges are kept with the entry (a hit skips their percentiles); unusable
    # ranges are computed again
    meta = json.loads((cached / "meta.json").read_text())
    assert len(meta["channel_ranges"]) == len(study.channels)
    (cached / "meta.json").write_text(json.dumps({**meta, "channel_ranges": [[1.0, 0.0]] * len(study.channels)}))
    np.testing.assert_array_equal(prepare(study, cache_root=tmp_path).channels, first.channels)
    (cached / "boundary.npy").write_bytes(b"damaged")
    third = prepare(study, cache_root=tmp_path)
    finish_writes()  # its entry, written again behind, lands before the next damage
    np.testing.assert_array_equal(first.boundary, third.boundary)
    (cached / "occupancy.npy").unlink()  # an entry missing an array is derived again
    fourth = prepare(study, cache_root=tmp_path)
    np.testing.assert_array_equal(first.occupancy, fourth.occupancy)


def test_what_needs_the_mask_or_the_label_maps_does_not_wait_for_the_brains_map(monkeypatch):
    """P(x), the occupancy grid, the bounds and the normalised channels are made while the brain's map, the
    slowest, is still being made: ``with_label_maps`` is given the label maps as they are returned, before the
    brain's is done, and ``with_mask`` the mask."""
    image = np.random.default_rng(0).random((24, 24, 24)).astype(np.float32)
    brain = np.zeros(image.shape, bool)
    brain[4:20, 5:19, 6:18] = True
    labels = np.zeros(image.shape, np.int16)
    labels[9:14, 9:14, 9:14] = 1
    study = Study.from_arrays({"t1": image}, np.eye(4), labels=labels, brain_mask=brain)
    structures = make_structures(study.structures, include_brain=True)
    brain_index = [s.name for s in structures].index(BRAIN)
    label_maps_given = threading.Event()
    seen: dict[str, np.ndarray] = {}
    exact = preprocess.signed_distance

    def brain_after_label_maps(inside, spacing, *args, name="a mask", **kwargs):
        if name.startswith(f"structure '{BRAIN}'"):  # holds the brain's map until P(x) could be made
            assert label_maps_given.wait(60), "the label maps waited for the brain's"
        return exact(inside, spacing, *args, name=name, **kwargs)

    def with_label_maps(maps):
        seen["label maps"] = np.delete(maps, brain_index, axis=0).copy()
        label_maps_given.set()

    monkeypatch.setattr(preprocess, "signed_distance", brain_after_label_maps)
    mask, boundary, _ = preprocess.mask_and_boundary_maps(
        study, structures, lambda message, fraction: None,
        with_mask=lambda given: seen.update(mask=given.copy()), with_label_maps=with_label_maps)
    np.testing.assert_array_equal(seen["mask"], mask)
    np.testing.assert_array_equal(seen["label maps"], np.delete(boundary, brain_index, axis=0))


def test_the_labelled_structures_do_not_wait_for_the_brain_mask(monkeypatch):
    """The structures drawn in the labels need no brain mask: their maps are begun while it is found (the brain's,
    the longest way, then meets less of their work), and come out as without the wait."""
    image = np.zeros((24, 24, 24), np.float32)
    image[4:20, 5:19, 6:18] = 1.0
    labels = np.zeros(image.shape, np.int16)
    labels[9:14, 9:14, 9:14] = 1
    study = Study.from_arrays({"t1": image}, np.eye(4), labels=labels)
    structures = make_structures(study.structures, include_brain=True)
    expected = preprocess.mask_and_boundary_maps(study, structures, lambda message, fraction: None)[1]
    begun = threading.Event()
    exact, find = preprocess.signed_distance, preprocess._brain_mask_and_tidiness

    def labelled_begins(inside, spacing, *args, name="a mask", **kwargs):
        if not name.startswith(f"structure '{BRAIN}'"):
            begun.set()
        return exact(inside, spacing, *args, name=name, **kwargs)

    def mask_once_a_label_began(given):
        assert begun.wait(60), "the labelled structures waited for the brain mask"
        return find(given)

    monkeypatch.setattr(preprocess, "signed_distance", labelled_begins)
    monkeypatch.setattr(preprocess, "_brain_mask_and_tidiness", mask_once_a_label_began)
    boundary = preprocess.mask_and_boundary_maps(study, structures, lambda message, fraction: None)[1]
    np.testing.assert_array_equal(boundary, expected)


def test_float16_rounding_of_the_cache_is_numpys_bit_for_bit():
    """P(x) and the maps are kept as float16; the quick rounding gives numpy's cast exactly, for values on every
    scale, halfway cases of the subnormal step among them, signed zeros, infinities and NaN."""
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(20_000) * scale for scale in (1e-9, 1e-7, 3e-6, 6e-5, 1e-2, 1.0, 7e4)])
    step = 2.0**-24
    edges = [0.0, -0.0, np.inf, -np.inf, np.nan, step / 2, 3 * step / 2, -5 * step / 2, 2.0**-14 - step / 2,
             2.0**-14, 65520.0, 1e-45]
    values = np.concatenate([values, edges]).astype(np.float32)
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16)
        rounded = as_float16(values)
    np.testing.assert_array_equal(rounded.view(np.uint16), expected.view(np.uint16))
    probability = derived_probability(np.linspace(-40.0, 60.0, 50_000, dtype=np.float32), 1.0)
    np.testing.assert_array_equal(as_float16(probability).view(np.uint16),
                                  probability.astype(np.float16).view(np.uint16))
