"""The metrics the README quotes, pinned: hand-computed cases and independent libraries at tolerances tight
enough that a small slip (OR for AND in Dice, σ = 1.4 for 1.5 in SSIM, a grid tolerance 30× off) fails.

No GPU: the geometry metrics read a field only through its ``distances``, so an analytic field stands in."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from conftest import analytic_prepared
from scipy import ndimage
from scipy.spatial import cKDTree
from scipy.spatial.distance import dice as scipy_dice_dissimilarity
from skimage.measure import marching_cubes
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from NeuralRaycastLib.grid import GRID_TOLERANCE_VOXELS, grid_corners, grid_corners_bounds, off_grid_mm
from NeuralRaycastLib.render import metrics
from NeuralRaycastLib.render.metrics import (
    contact_sheet,
    depth_picture,
    dssim,
    l1,
    normal_picture,
    psnr,
    save_png,
    ssim,
    ssim_map,
    to_uint8,
)
from NeuralRaycastLib.train.evaluate import dice, geometry_metrics

# ---------------------------------------------------------------------------------------------------------
# Dice


def test_dice_of_hand_counted_overlaps():
    a = np.zeros((4, 5, 6), bool)
    b = np.zeros_like(a)
    a[0, 0, :6] = True  # 6 voxels
    b[0, 0, 3:6] = True
    b[1, 1, 0] = True  # 4 voxels, 3 of them in a
    assert dice(a, b) == 2 * 3 / (6 + 4)  # 0.6 exactly; with OR for AND it would be 1.4
    assert dice(a, a) == 1.0
    c = np.zeros_like(a)
    c[3, 4, :] = True
    assert dice(a, c) == 0.0  # disjoint
    assert dice(a, np.zeros_like(a)) == 0.0  # one side empty
    assert dice(np.zeros_like(a), np.zeros_like(a)) == 1.0  # both empty: they agree (documented in dice)


@pytest.mark.parametrize("seed", range(4))
def test_dice_is_scipys_symmetric_and_never_above_one(seed):
    rng = np.random.default_rng(seed)
    a = rng.random((9, 10, 11)) < rng.uniform(0.05, 0.9)
    b = rng.random(a.shape) < rng.uniform(0.05, 0.9)
    expected = 1.0 - scipy_dice_dissimilarity(a.ravel(), b.ravel())
    assert dice(a, b) == pytest.approx(expected, abs=1e-12)
    assert dice(a, b) == dice(b, a)
    assert 0.0 < dice(a, b) < 1.0
    assert dice(a, a | b) <= 1.0


# ---------------------------------------------------------------------------------------------------------
# Surface distances and HD95 (geometry_metrics)


class AnalyticField:
    """Exact signed distances in place of a trained field: all that geometry_metrics reads of one."""

    def __init__(self, *sdfs: Callable[[np.ndarray], np.ndarray]):
        self.sdfs = sdfs

    def distances(self, points: np.ndarray) -> np.ndarray:
        return np.stack([sdf(np.asarray(points, np.float64)) for sdf in self.sdfs], axis=-1)


def sphere(centre, radius: float) -> Callable[[np.ndarray], np.ndarray]:
    return lambda points: np.linalg.norm(points - np.asarray(centre, np.float64), axis=-1) - radius


CENTRE = np.array([0.3, -0.2, 0.1])  # off the voxel centres: no grid value is exactly 0


def sphere_study(radius: float, spacing: float = 1.0, margin: float = 6.0):
    low, high = CENTRE - radius - margin, CENTRE + radius + margin
    return analytic_prepared({"s": sphere(CENTRE, radius)}, spacing, low, high)


@pytest.mark.parametrize(("radius", "gap"), [(8.0, 0.5), (8.0, 1.5), (12.0, 0.7)])
def test_concentric_spheres_are_their_gap_apart(radius, gap):
    """Every point of either surface is ``gap`` from the other: mean and HD95 are the gap (within the
    discretisation of 1 mm voxels). Dice is 2|inner| / (|inner| + |outer|) counted in voxels, close to the
    volumes' 2R³ / (R³ + (R + g)³)."""
    prepared = sphere_study(radius)
    outer = sphere(CENTRE, radius + gap)
    result = geometry_metrics(AnalyticField(outer), prepared)["s"]
    assert result["mean_surface_distance_mm"] == pytest.approx(gap, abs=0.005)
    assert result["hd95_mm"] == pytest.approx(gap, abs=0.015)
    inner_voxels = int((prepared.boundary[0] < 0).sum())
    outer_voxels = int((outer(_grid_points(prepared.affine, prepared.boundary[0].shape)) < 0).sum())
    assert result["dice"] == 2 * inner_voxels / (inner_voxels + outer_voxels)
    assert result["dice"] == pytest.approx(2 * radius**3 / (radius**3 + (radius + gap) ** 3), abs=0.03)


def test_shifted_spheres_have_the_analytic_mean_and_95th_percentile():
    """A sphere of radius R against the same sphere moved by c: a point whose normal u has u·ĉ = t lies
    |√(R² + c² + 2Rct) − R| from the other sphere, the same both ways. The metric counts marching-cubes
    vertices, which fall where the surface crosses the grid's edges: |u_x| + |u_y| + |u_z| of them per unit
    area. Over the sphere so weighted, for R = 10 and c = 2: mean 1.009 mm, 95th percentile 1.881 mm (the
    90th is 1.776 mm; unweighted they would be 1.0 and 1.9)."""
    radius, shift = 10.0, 2.0
    n = 400_000
    u = _fibonacci_sphere(n)
    exact = np.abs(np.sqrt(radius**2 + shift**2 + 2 * radius * shift * u[:, 0]) - radius)
    weight = np.abs(u).sum(axis=1)
    order = np.argsort(exact)
    cumulative = np.cumsum(weight[order]) / weight.sum()
    mean, p95 = float((exact * weight).sum() / weight.sum()), float(exact[order][np.searchsorted(cumulative, 0.95)])
    assert (mean, p95) == pytest.approx((1.0087, 1.8813), abs=1e-3)
    prepared = sphere_study(radius, spacing=0.5)
    result = geometry_metrics(AnalyticField(sphere(CENTRE + [shift, 0, 0], radius)), prepared)["s"]
    assert result["mean_surface_distance_mm"] == pytest.approx(mean, abs=0.003)
    assert result["hd95_mm"] == pytest.approx(p95, abs=0.01)


def _fibonacci_sphere(n: int) -> np.ndarray:
    """``n`` near-uniform unit vectors (a Fibonacci lattice)."""
    golden = np.pi * (3.0 - np.sqrt(5.0))
    z = 1.0 - 2.0 * (np.arange(n) + 0.5) / n
    ring = np.sqrt(1.0 - z * z)
    return np.stack([ring * np.cos(golden * np.arange(n)), ring * np.sin(golden * np.arange(n)), z], axis=-1)


def _percentile_95(values: np.ndarray) -> float:
    """The 95th percentile with linear interpolation between order statistics, written out."""
    ordered = np.sort(values)
    position = 0.95 * (len(ordered) - 1)
    below = int(np.floor(position))
    above = min(below + 1, len(ordered) - 1)
    return float(ordered[below] + (position - below) * (ordered[above] - ordered[below]))


def _vertices(volume: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """Marching cubes of a grid that is positive on its border, in RAS mm (one vertex per crossed edge)."""
    vertices = marching_cubes(volume.astype(np.float32), level=0.0, allow_degenerate=False)[0].astype(np.float64)
    return vertices @ affine[:3, :3].T + affine[:3, 3]


def test_surface_distances_are_the_two_way_pool_recomputed_with_scipy():
    """The learned surface against the segmentation's map (trilinear, as scipy's map_coordinates samples it)
    and the segmentation's surface against the field, pooled: mean and HD95 to within float32 rounding.
    An ellipsoid against a sphere gives distances that vary over the surface, so the percentile matters."""
    prepared = sphere_study(9.0)
    axes = np.array([10.5, 8.0, 9.0])

    def ellipsoid(points: np.ndarray) -> np.ndarray:  # negative inside, not a true distance: fine for this
        return (np.linalg.norm((points - CENTRE) / axes, axis=-1) - 1.0) * axes.min()

    field = AnalyticField(ellipsoid)
    result = geometry_metrics(field, prepared)["s"]

    affine, boundary = prepared.affine, prepared.boundary[0]
    learned = np.asarray(field.distances(_grid_points(affine, boundary.shape))[:, 0], np.float32)
    learned_vertices = _vertices(learned.reshape(boundary.shape), affine)
    truth_vertices = _vertices(boundary, affine)
    ijk = (learned_vertices - affine[:3, 3]) @ np.linalg.inv(affine[:3, :3]).T
    one_way = np.abs(ndimage.map_coordinates(boundary.astype(np.float64), ijk.T, order=1, mode="nearest"))
    other_way = np.abs(ellipsoid(truth_vertices))
    pooled = np.concatenate([one_way, other_way])
    assert one_way.mean() != pytest.approx(other_way.mean(), rel=0.05)  # both ways count
    assert result["mean_surface_distance_mm"] == pytest.approx(pooled.mean(), rel=1e-6)
    assert result["hd95_mm"] == pytest.approx(_percentile_95(pooled), rel=1e-6)
    assert result["hd95_mm"] > 1.5 * result["mean_surface_distance_mm"]


def _grid_points(affine: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    ijk = np.indices(shape).reshape(3, -1).T.astype(np.float64)
    return ijk @ affine[:3, :3].T + affine[:3, 3]


def test_surface_distances_match_a_kd_tree_on_the_exact_sphere():
    """Independent of the grids: the learned surface's vertices against a dense sampling of the exact
    segmentation sphere (scipy's k-d tree), and its sphere against the learned field. On 0.5 mm voxels the
    segmentation's map, sampled between voxel centres, is close to the exact distance, far closer than the
    step from the 90th to the 95th percentile."""
    radius = 7.0
    prepared = sphere_study(radius, spacing=0.5, margin=3.0)
    learned = sphere(CENTRE + [0.0, 0.9, -0.4], radius - 0.6)
    result = geometry_metrics(AnalyticField(learned), prepared)["s"]

    on_truth = CENTRE + radius * _fibonacci_sphere(400_000)
    learned_grid = np.asarray(learned(_grid_points(prepared.affine, prepared.boundary[0].shape)), np.float32)
    learned_vertices = _vertices(learned_grid.reshape(prepared.boundary[0].shape), prepared.affine)
    one_way = cKDTree(on_truth).query(learned_vertices)[0]
    other_way = np.abs(learned(_vertices(prepared.boundary[0], prepared.affine)))
    pooled = np.concatenate([one_way, other_way])
    assert result["mean_surface_distance_mm"] == pytest.approx(pooled.mean(), abs=0.002)
    assert result["hd95_mm"] == pytest.approx(np.percentile(pooled, 95), abs=0.002)


def test_dice_is_against_the_labels_where_there_are_labels():
    """With a label map the truth is the structure's voxels, not the sign of its boundary map."""
    prepared = sphere_study(8.0)
    inner = sphere(CENTRE, 4.0)(_grid_points(prepared.affine, prepared.boundary[0].shape)).reshape(
        prepared.boundary[0].shape) < 0
    prepared.study.labels = inner.astype(np.int16)  # label 1 is structure "s"
    field = AnalyticField(sphere(CENTRE, 8.0))
    learned_inside = prepared.boundary[0] < 0
    expected = 2 * inner.sum() / (inner.sum() + learned_inside.sum())
    assert geometry_metrics(field, prepared)["s"]["dice"] == pytest.approx(expected, abs=1e-12)
    assert expected < 0.5  # far from the 1.0 the boundary map would give


def test_dice_of_the_brain_is_against_the_brain_mask():
    """The brain (a structure from the mask, not from labels) is compared with the prepared mask."""
    from NeuralRaycastLib.study.structures import BRAIN, Structure

    prepared = sphere_study(8.0)
    prepared.structures = [Structure(BRAIN, (), (1.0, 1.0, 1.0))]
    points = _grid_points(prepared.affine, prepared.mask.shape)
    prepared.mask = (sphere(CENTRE, 5.0)(points) < 0).reshape(prepared.mask.shape)
    learned_inside = prepared.boundary[0] < 0
    expected = 2 * prepared.mask.sum() / (prepared.mask.sum() + learned_inside.sum())
    assert geometry_metrics(AnalyticField(sphere(CENTRE, 8.0)), prepared)[BRAIN]["dice"] == pytest.approx(expected,
                                                                                                          abs=1e-12)
    assert expected < 0.5


def test_surface_distances_without_a_learned_surface_are_missing_not_a_number():
    """A field positive everywhere has no surface: there is no distance between a surface and nothing, so the
    distances are missing (None: null in JSON, "–" in tables), and Dice is 0. Neither surface: Dice 1 (they
    agree), distances still missing."""
    prepared = sphere_study(6.0)
    result = geometry_metrics(AnalyticField(lambda p: np.linalg.norm(p - CENTRE, axis=-1) + 1.0), prepared)["s"]
    assert result["dice"] == 0.0
    assert result["mean_surface_distance_mm"] is None and result["hd95_mm"] is None
    assert result["learned_volume_ml"] == 0.0 and result["volume_difference_percent"] == -100.0
    prepared.boundary[:] = np.abs(prepared.boundary) + 1.0
    empty = geometry_metrics(AnalyticField(lambda p: np.full(len(p), 5.0)), prepared)["s"]
    assert (empty["dice"], empty["mean_surface_distance_mm"], empty["hd95_mm"]) == (1.0, None, None)


# ---------------------------------------------------------------------------------------------------------
# PSNR and L1


@pytest.mark.parametrize(("data_range", "error", "expected_db"),
                         [(1.0, 0.1, 20.0), (255.0, 5.1, 20 * np.log10(50.0)), (2.0, 0.02, 40.0)])
def test_psnr_of_a_constant_error_is_20_log10_range_over_error(data_range, error, expected_db):
    rng = np.random.default_rng(0)
    a = rng.uniform(0.2, 0.8, (12, 14, 3)) * data_range
    signs = np.where(rng.random(a.shape) < 0.5, -1.0, 1.0)  # the error's sign must not matter
    b = a + signs * error
    assert psnr(a, b, data_range) == pytest.approx(expected_db, rel=1e-12)
    assert l1(a, b) == pytest.approx(error, rel=1e-12)


@pytest.mark.parametrize(("shape", "data_range"), [((30, 40), 1.0), ((25, 31, 3), 255.0), ((20, 22, 4), 2.0)])
def test_psnr_agrees_with_scikit_image(shape, data_range):
    rng = np.random.default_rng(len(shape))
    low = -data_range / 2 if data_range == 2.0 else 0.0  # range 2: images in [-1, 1]
    a = low + rng.random(shape) * data_range
    b = np.clip(a + rng.normal(0.0, 0.05 * data_range, shape), low, low + data_range)
    expected = peak_signal_noise_ratio(a, b, data_range=data_range)
    assert psnr(a, b, data_range) == pytest.approx(expected, rel=1e-10)
    assert psnr(a, a, data_range) == float("inf")


def test_psnr_of_8_bit_images_does_not_wrap_around():
    """20 levels apart: in 8-bit arithmetic the squared error would wrap around (400 mod 256)."""
    a = np.full((8, 8), 10, np.uint8)
    b = np.full((8, 8), 30, np.uint8)
    assert psnr(a, b, 255.0) == pytest.approx(20 * np.log10(255.0 / 20.0), rel=1e-12)
    assert psnr(b, a, 255.0) == psnr(a, b, 255.0)
    assert psnr(a, b, 255.0) == pytest.approx(peak_signal_noise_ratio(a, b, data_range=255), rel=1e-10)


# ---------------------------------------------------------------------------------------------------------
# SSIM and DSSIM

SSIM_TOLERANCE = 1e-9


def _images(shape, data_range: float, seed: int):
    rng = np.random.default_rng(seed)
    a = rng.random(shape) * data_range
    return a, np.clip(a + rng.normal(0.0, 0.15 * data_range, shape), 0.0, data_range)


def _scikit_ssim(a, b, data_range: float, sigma: float = 1.5, full: bool = False):
    return structural_similarity(a, b, gaussian_weights=True, sigma=sigma, use_sample_covariance=False,
                                 data_range=data_range, channel_axis=-1 if a.ndim == 3 else None, full=full)


SSIM_CASES = [((48, 64), 1.0, 0), ((40, 52, 3), 255.0, 1), ((33, 35, 4), 2.0, 2), ((11, 11), 1.0, 3),
              ((64, 48, 3), 1.0, 4)]


@pytest.mark.parametrize(("shape", "data_range", "seed"), SSIM_CASES)
def test_ssim_and_its_map_are_scikit_images(shape, data_range, seed):
    a, b = _images(shape, data_range, seed)
    expected, expected_map = _scikit_ssim(a, b, data_range, full=True)
    assert ssim(a, b, data_range) == pytest.approx(expected, abs=SSIM_TOLERANCE)
    assert dssim(a, b, data_range) == pytest.approx((1.0 - expected) / 2.0, abs=SSIM_TOLERANCE)
    np.testing.assert_allclose(ssim_map(a, b, data_range).reshape(expected_map.shape), expected_map, rtol=0,
                               atol=SSIM_TOLERANCE)
    assert ssim(a, a, data_range) == pytest.approx(1.0, abs=1e-12) and dssim(a, a, data_range) == pytest.approx(
        0.0, abs=1e-12)
    if data_range == 1.0:  # the default range
        assert ssim(a, b) == ssim(a, b, 1.0) and dssim(a, b) == dssim(a, b, 1.0)
        np.testing.assert_array_equal(ssim_map(a, b), ssim_map(a, b, 1.0))


@pytest.mark.parametrize("change", [("SSIM_SIGMA", 1.4), ("SSIM_TRUNCATE", 4.0), ("SSIM_K1", 0.011),
                                    ("SSIM_K2", 0.033)])
def test_ssim_tolerance_catches_a_wrong_window_or_constant(monkeypatch, change):
    """The tolerance is tight enough: σ = 1.4 for 1.5, a window truncated at 4σ, or K1/K2 10 % off, moves
    SSIM off scikit-image's by far more than it allows (a tolerance of 1e-3 let σ = 1.4 pass)."""
    a, b = _images((48, 64), 1.0, 0)
    expected = _scikit_ssim(a, b, 1.0)
    monkeypatch.setattr(metrics, *change)
    assert abs(ssim(a, b) - expected) > 10 * SSIM_TOLERANCE


def test_ssim_refuses_images_of_different_shapes_or_smaller_than_its_window():
    a, b = _images((12, 11), 1.0, 5)
    with pytest.raises(ValueError, match="at least 11 pixels"):
        ssim(a[:, :10], b[:, :10])
    with pytest.raises(ValueError, match="differ in shape"):
        ssim(a[:11], b[:12])
    assert ssim(a[:11], b[:11]) == pytest.approx(_scikit_ssim(a[:11], b[:11], 1.0), abs=SSIM_TOLERANCE)  # one window


# ---------------------------------------------------------------------------------------------------------
# The grid tolerance


def _reference(spacing, angle_deg: float = 0.0) -> np.ndarray:
    """A grid of voxel sides ``spacing`` (mm), rotated about R by ``angle_deg`` (column norms stay the sides,
    row norms do not)."""
    angle = np.radians(angle_deg)
    rotation = np.array([[1, 0, 0], [0, np.cos(angle), -np.sin(angle)], [0, np.sin(angle), np.cos(angle)]])
    affine = np.eye(4)
    affine[:3, :3] = rotation @ np.diag(spacing)
    affine[:3, 3] = (-40.0, 25.0, -12.0)
    return affine


SHAPE = (40, 30, 12)


@pytest.mark.parametrize(("spacing", "angle"), [((1.0, 1.0, 1.0), 0.0), ((0.94, 0.94, 1.2), 0.0),
                                                ((2.0, 3.0, 0.5), 0.0), ((1.2, 0.7, 3.0), 35.0)])
@pytest.mark.parametrize("axis", range(3))
def test_a_shift_is_refused_just_beyond_the_tolerance_and_kept_just_within(spacing, angle, axis):
    """The tolerance is GRID_TOLERANCE_VOXELS of the reference's smallest voxel side, in mm along any RAS
    axis: a shift of 0.98 of it is the same grid, 1.02 of it is not (and is reported as the shift)."""
    reference = _reference(spacing, angle)
    tolerance = GRID_TOLERANCE_VOXELS * min(spacing)
    for factor, same in ((0.98, True), (1.02, False)):
        moved = reference.copy()
        moved[axis, 3] += factor * tolerance
        offset = off_grid_mm(moved, reference, SHAPE)
        if same:
            assert offset is None, (factor, spacing)
        else:
            assert offset == pytest.approx(factor * tolerance, rel=1e-9)
    assert off_grid_mm(reference, reference, SHAPE) is None


def test_the_tolerance_is_a_tenth_of_a_voxel():
    """By hand, so that a tolerance 30× looser or tighter cannot pass by moving both sides of a test: a tenth
    of the smallest side, 0.8 mm."""
    reference = np.diag([0.8, 1.0, 2.5, 1.0])  # its corner at the origin: only the voxel sides count
    moved = reference.copy()
    moved[0, 3] += 0.079
    assert off_grid_mm(moved, reference, SHAPE) is None
    moved[0, 3] += 0.002
    assert off_grid_mm(moved, reference, SHAPE) == pytest.approx(0.081)
    exact = np.diag([1.25, 1.25, 2.5, 1.0])  # a tenth of 1.25 mm is 0.125, exact in binary, as are the corners
    moved = exact.copy()
    moved[2, 3] = 0.125
    assert off_grid_mm(moved, exact, SHAPE) is None  # at the tolerance: the same grid ("more than" it is not)


def _rotated_about_centre(affine: np.ndarray, shape, angle_deg: float) -> np.ndarray:
    """The same grid turned about S (z) through its centre."""
    angle = np.radians(angle_deg)
    turn = np.eye(4)
    turn[:2, :2] = [[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]]
    centre = affine @ np.array([(n - 1) / 2 for n in shape] + [1.0])
    to_centre, back = np.eye(4), np.eye(4)
    to_centre[:3, 3], back[:3, 3] = -centre[:3], centre[:3]
    return back @ turn @ to_centre @ affine


@pytest.mark.parametrize("spacing", [(1.0, 1.0, 1.0), (0.94, 0.94, 1.2), (1.5, 0.6, 4.0)])
def test_a_rotation_is_measured_at_the_corners(spacing):
    """An axis-aligned grid turned by θ about its centre: its corners (±a, ±b) move by up to
    a(1 − cos θ) + b sin θ along x (and b(1 − cos θ) + a sin θ along y); the angle that moves them by
    exactly the tolerance is found, and 0.98 of it passes, 1.02 of it does not."""
    reference = _reference(spacing)
    a, b = [(n - 1) * s / 2 for n, s in zip(SHAPE[:2], spacing[:2], strict=True)]
    tolerance = GRID_TOLERANCE_VOXELS * min(spacing)

    def largest_move(theta: float) -> float:
        return max(a * (1 - np.cos(theta)) + b * np.sin(theta), b * (1 - np.cos(theta)) + a * np.sin(theta))

    low, high = 0.0, 0.1
    for _ in range(100):  # bisection: largest_move grows with θ
        low, high = ((low + high) / 2, high) if largest_move((low + high) / 2) < tolerance else (low, (low + high) / 2)
    limit = np.degrees(low)
    assert off_grid_mm(_rotated_about_centre(reference, SHAPE, 0.98 * limit), reference, SHAPE) is None
    offset = off_grid_mm(_rotated_about_centre(reference, SHAPE, 1.02 * limit), reference, SHAPE)
    assert offset == pytest.approx(largest_move(np.radians(1.02 * limit)), rel=1e-9)


def test_grid_corners_are_the_outermost_voxel_centres():
    affine = np.diag([2.0, 3.0, 4.0, 1.0])
    affine[:3, 3] = (1.0, 2.0, 3.0)
    corners = grid_corners(affine, (5, 6, 7))
    expected = [[x, y, z] for x in (1.0, 9.0) for y in (2.0, 17.0) for z in (3.0, 27.0)]
    np.testing.assert_array_equal(corners, expected)
    np.testing.assert_array_equal(grid_corners_bounds(affine, (5, 6, 7)), [[1.0, 2.0, 3.0], [9.0, 17.0, 27.0]])


# ---------------------------------------------------------------------------------------------------------
# Pictures written beside the metrics


def test_to_uint8_clips_and_rounds_to_the_nearest_level(tmp_path):
    image = np.array([[-0.1, 0.0, 0.2, 0.5, 1.0, 1.2]])
    np.testing.assert_array_equal(to_uint8(image), [[0, 0, 51, 128, 255, 255]])
    from PIL import Image

    path = save_png(np.tile(image[..., None], (2, 1, 3)), tmp_path / "new" / "folder" / "picture.png")
    np.testing.assert_array_equal(np.asarray(Image.open(path))[1, :, 2], [0, 0, 51, 128, 255, 255])
    beside = save_png(np.zeros((2, 3)), path.parent / "beside.png")  # a second picture in the same folder
    np.testing.assert_array_equal(np.asarray(Image.open(beside)), np.zeros((2, 3)))


def test_contact_sheet_defaults_to_a_square_of_columns_two_pixels_apart():
    images = [np.full((4, 5, 3), i / 10) for i in range(5)]
    sheet = contact_sheet(images)
    assert sheet.shape == (2 * 4 + 2, 3 * 5 + 2 * 2, 3)  # ceil(sqrt(5)) = 3 columns, 2 rows
    assert sheet[6, 7, 0] == pytest.approx(0.4) and sheet[4, 0, 0] == 0.0 and sheet[0, 5, 0] == 0.0
    np.testing.assert_array_equal(contact_sheet(images[:1]), images[0])
    with pytest.raises(ValueError, match="^no images for a contact sheet$"):
        contact_sheet([])


def test_depth_and_normal_pictures():
    """Depth: the 1st percentile of the hits is bright (1.0), the 99th dim (0.2), linear between and clipped
    beyond; a spread below 1e-6 mm is not divided by; empty pixels (depth 0) are black, hits under 1 mm
    included. Normals map (-1, 1) onto (0, 1), empty pixels black."""
    depth = np.arange(1.0, 102.0)[None]  # hits 1..101 mm: 1st percentile 2, 99th 100
    np.testing.assert_allclose(depth_picture(depth)[0, [0, 1, 50, 99, 100]], [1.0, 1.0, 1.0 - 0.8 * 49 / 98, 0.2, 0.2])
    np.testing.assert_allclose(depth_picture(np.array([[0.0, 0.5, 0.7]])), [[0.0, 1.0, 0.2]])
    narrow = 10.0 + 0.005 * np.arange(101.0)  # 0.5 mm of depths: 1st % 10.005, 99th % 10.495
    np.testing.assert_allclose(depth_picture(narrow[None])[0, 50], 1.0 - 0.8 * 0.245 / 0.49)
    np.testing.assert_array_equal(depth_picture(np.full((2, 2), 7.0)), np.ones((2, 2)))
    assert np.all(depth_picture(np.zeros((3, 3))) == 0.0)
    normals = np.zeros((1, 3, 3))
    normals[0, 0] = (1.0, 0.0, 0.0)
    normals[0, 1] = (0.0, -0.6, 0.8)
    np.testing.assert_allclose(normal_picture(normals), [[[1.0, 0.5, 0.5], [0.5, 0.2, 0.9], [0.0, 0.0, 0.0]]])
