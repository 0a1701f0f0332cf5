"""Geometry from the Gaussians: the structure weights' occupancy (shaders/gaussian_occupancy.slang's occupancyAt and its
hand-written backward, logits and slopes) against a float64 reference and central differences on the tiny scene of
test_gaussian_gradients.py, the weights started from the boundary maps, and the signed distances that Dice and
meshes are taken from."""

from __future__ import annotations

import numpy as np
import pytest
from field_reference import central_difference
from gaussian_reference import occupancy
from test_gaussian_gradients import BOX, tiny_set

from NeuralRaycastLib.gaussians.geometry import (
    MAX_STRUCTURES,
    StructureOccupancy,
    filled_occupancy,
    occupancy_loss,
    occupancy_signed_distances,
    signed_distances,
)
from NeuralRaycastLib.gaussians.scene import GaussianScene, GaussianSet, GridShape, MarchSettings

pytestmark = pytest.mark.gpu

STRUCTURES = 3
POINTS = 40
#: The share of the Gaussians' thickness the structure weights read them with here (1 would be the pictures').
THIN = 0.6


@pytest.fixture(scope="module")
def weighted(gpu):
    gaussians = tiny_set()
    scene = GaussianScene(gpu, gaussians, GridShape.for_box(BOX, 2.5), density_scale=0.8, march=MarchSettings(0.25),
                          geometry_thickness=THIN)
    rng = np.random.default_rng(4)
    weights = np.concatenate([rng.normal(0.0, 1.5, (gaussians.count, STRUCTURES)),
                              rng.normal(0.0, 1.0, (gaussians.count, STRUCTURES))], axis=1).astype(np.float32)
    points = np.random.default_rng(5).uniform(BOX[0], BOX[1], (POINTS, 3)).astype(np.float32)
    return StructureOccupancy(scene, weights), weights.astype(np.float64), points.astype(np.float64)


def test_occupancy_is_the_float64_reference(weighted):
    occupied, weights, points = weighted
    values, cover = occupied.occupancy(points)
    expected, expected_cover = occupancy(occupied.scene.parameters(), occupied.scene.count, weights, points, THIN)
    assert (expected_cover > 0.05).sum() >= POINTS // 3, "the points should meet the Gaussians"
    np.testing.assert_allclose(cover, expected_cover, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-6)


def test_more_structures_than_the_kernels_hold_are_refused(weighted):
    """The occupancy kernels sum at most MAX_STRUCTURES structures a point: weights for more are refused in one
    line instead of read in part."""
    occupied, _, _ = weighted
    too_many = np.zeros((occupied.scene.count, 2 * (MAX_STRUCTURES + 1)), np.float32)
    with pytest.raises(ValueError, match=f"at most {MAX_STRUCTURES} structures"):
        occupied.set_weights(too_many)


def test_a_geometry_thickness_outside_its_range_is_refused(gpu):
    for thickness in (0.0, 1.5):
        with pytest.raises(ValueError, match="geometry thickness"):
            GaussianScene(gpu, tiny_set(), GridShape.for_box(BOX, 2.5), geometry_thickness=thickness)


def test_occupancy_backward_matches_central_differences(weighted):
    """∂(Σ u·o)/∂(logits, slopes) by hand on the device against central differences of the reference; the
    Gaussian no point reaches gets none."""
    occupied, weights, points = weighted
    u = np.random.default_rng(6).normal(size=(POINTS, STRUCTURES))
    gradient = occupied.backward(points, u).astype(np.float64)
    params, n = occupied.scene.parameters().astype(np.float64), occupied.scene.count

    def loss(flat: np.ndarray) -> float:
        return float((occupancy(params, n, flat.reshape(n, 2 * STRUCTURES), points, THIN)[0] * u).sum())

    flat = weights.reshape(-1)
    numeric = central_difference(loss, flat, np.eye(flat.size), 1e-6)
    assert np.abs(numeric.reshape(n, -1)[:, :STRUCTURES]).max() > 0.05
    assert np.abs(numeric.reshape(n, -1)[:, STRUCTURES:]).max() > 0.05, "the slopes should matter"
    np.testing.assert_allclose(gradient.reshape(-1), numeric, rtol=1e-3, atol=1e-5)
    assert not gradient[6].any()  # the Gaussian far outside the box


def test_structure_weights_start_as_the_boundary_maps_across_each_gaussian(gpu):
    """A plane surface x = 2.3 mm of a study of 1 mm voxels and flat Gaussians on it, their normals along +x or
    -x: the starting weights are the maps' logit, linear across each Gaussian, so that the occupancy is inside
    (above 1/2) on the plane's inner side and outside on the other, within a Gaussian's width of it, whichever way
    its normal points, as no logit alone could say."""
    from types import SimpleNamespace

    from NeuralRaycastLib.gaussians.geometry import initial_structure_weights

    shape = (12, 10, 10)
    x = np.indices(shape)[0].astype(np.float64)
    prepared = SimpleNamespace(boundary=(x - 2.3 - 3.0)[None].astype(np.float32), spacing=np.ones(3),
                               affine=np.array([[1, 0, 0, -3.0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]))
    count = 16
    rng = np.random.default_rng(3)
    positions = np.column_stack([np.full(count, 2.3), rng.uniform(2, 7, count), rng.uniform(2, 7, count)])
    towards_x = np.array([np.sqrt(0.5), 0.0, np.sqrt(0.5), 0.0])  # turns z onto +x
    towards_minus_x = np.array([np.sqrt(0.5), 0.0, -np.sqrt(0.5), 0.0])
    rotations = np.where((np.arange(count) % 2 == 0)[:, None], towards_x, towards_minus_x)
    gaussians = GaussianSet(positions, np.log(np.tile([1.2, 1.2, 0.8], (count, 1))), rotations, np.zeros(count),
                            np.zeros((count, 6, 3)))
    box = np.array([[-3.0, 0, 0], [8.0, 9, 9]])
    scene = GaussianScene(gpu, gaussians, GridShape.for_box(box, 2.0), geometry_thickness=THIN)
    weights = initial_structure_weights(prepared, scene)
    assert np.abs(weights[:, 0]).max() < 1e-4  # on the surface: no side from the logit
    sides = np.sign(weights[:, 1])
    np.testing.assert_array_equal(sides, np.where(np.arange(count) % 2 == 0, -1.0, 1.0))  # inside is -x
    points = np.column_stack([np.linspace(1.6, 3.0, 8), np.full(8, 4.5), np.full(8, 4.5)])
    values, cover = StructureOccupancy(scene, weights).occupancy(points)
    assert (cover > 0.05).all()
    np.testing.assert_array_equal(values[:, 0] > 0.5, points[:, 0] < 2.3)


def test_occupancy_loss_leaves_out_uncovered_points():
    values = np.array([[0.9, 0.2], [0.0, 0.0], [0.4, 0.6]])
    loss, d = occupancy_loss(values, np.array([1.0, 0.0, 0.5]), np.array([[1, 0], [1, 1], [0, 1]], np.float32))
    assert loss == pytest.approx((0.01 + 0.04 + 0.16 + 0.16) / 4)
    assert not d[1].any() and d[0, 0] < 0 < d[2, 0]


def test_uncovered_voxels_take_the_nearest_covered_occupancy_and_give_a_signed_distance():
    """A shell of covered voxels, inside occupied: its hollow fills as inside, the outside stays out, and the
    zero level lies halfway between the last inside and first outside voxel centres."""
    shape = (12, 12, 12)
    ijk = np.indices(shape).transpose(1, 2, 3, 0) - 5.5
    radius = np.linalg.norm(ijk, axis=-1)
    coverage = np.where(np.abs(radius - 4) < 1, 1.0, 0.0)
    occupancy_grid = np.where(radius < 4, 0.9, 0.1)[None]
    filled = filled_occupancy(occupancy_grid, coverage)
    assert (filled[0][radius < 3] == 0.9).all() and (filled[0][radius > 5] == 0.1).all()
    distances = signed_distances(filled[0] > 0.5, np.array([2.0, 2.0, 2.0]))
    assert (distances[radius < 4] < 0).all() and (distances[radius >= 4] > 0).all()
    assert np.abs(distances[(radius >= 3.5) & (radius < 4)]).min() == pytest.approx(1.0)


@pytest.mark.parametrize("level", [3.2, 3.5, 3.8])
def test_the_zero_level_lies_where_the_occupancy_crosses_one_half(level):
    """An occupancy falling linearly across a plane between voxel centres: the signed distances' zero level, as
    marching cubes places it between the border voxels, lies where the occupancy is 1/2, not halfway between the
    centres (the mask's own distances put it at 3.5 whatever the occupancy); the inside is the mask's, and away
    from the border the distances are the mask's."""
    spacing = np.array([2.0, 2.0, 2.0])
    x = np.indices((10, 6, 6))[0].astype(np.float64)
    occupancy = np.clip(0.5 - 0.4 * (x - level), 0.0, 1.0)
    distances = occupancy_signed_distances(occupancy, spacing)
    np.testing.assert_array_equal(distances < 0, occupancy > 0.5)
    a, b = distances[3, 2, 2], distances[4, 2, 2]  # the border: x = 3 inside, x = 4 outside
    assert 3.0 + a / (a - b) == pytest.approx(level, abs=1e-6)
    far = signed_distances(occupancy > 0.5, spacing)
    np.testing.assert_array_equal(distances[:2], far[:2])
    np.testing.assert_array_equal(distances[6:], far[6:])


def test_joint_occupancy_loss_backward_matches_central_differences(weighted):
    """The occupancy loss taken during the picture steps, weight · Σ_covered Σ_k (o_k - y_k)² / (M·K), on the
    device: its value, and its gradient to the logits and to every Gaussian's position, scale and rotation
    (none to density or colour) against central differences of the float64 reference."""
    from NeuralRaycastLib.gaussians.geometry import COVERED, JointStructures, StructureTrainConfig

    occupied, weights, points = weighted
    scene, n, weight = occupied.scene, occupied.scene.count, 1.7
    inside = (np.random.default_rng(7).random((POINTS, STRUCTURES)) < 0.5).astype(np.float64)
    params = scene.parameters().astype(np.float64)

    def loss(p: np.ndarray, flat_weights: np.ndarray) -> float:
        values, cover = occupancy(p, n, flat_weights.reshape(n, 2 * STRUCTURES), points, THIN)
        covered = (cover >= COVERED)[:, None]
        return weight * float((np.where(covered, values - inside, 0.0) ** 2).sum() / (POINTS * STRUCTURES))

    joint = JointStructures(scene, weights, weight, StructureTrainConfig())
    scene.zero_gradients()
    joint.backward(points, inside)
    assert joint.take_loss() == pytest.approx(loss(params, weights.reshape(-1)) / weight, rel=1e-4)
    assert joint.take_loss() == 0.0
    d_weights = joint.weight_gradients().astype(np.float64).reshape(-1)
    gradient = scene.gradients().astype(np.float64)
    scene.zero_gradients()

    numeric = central_difference(lambda flat: loss(params, flat), weights.reshape(-1), np.eye(d_weights.size), 1e-6)
    assert np.abs(numeric).max() > 1e-3
    np.testing.assert_allclose(d_weights, numeric, rtol=1e-3, atol=1e-6)

    shape_part = slice(0, 10 * n)  # positions, log-scales, rotations
    assert not gradient[10 * n :].any()  # density and colour take no part in the occupancy
    for kind, (first, last) in {"position": (0, 3), "log-scale": (3, 6), "rotation": (6, 10)}.items():
        assert np.abs(gradient[first * n : last * n]).max() > 1e-4, f"no {kind} gradient"
    scale = np.abs(gradient).max()
    rng = np.random.default_rng(8)
    directions = np.zeros((3, params.size))
    directions[:, shape_part] = rng.normal(size=(3, 10 * n))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    numeric = central_difference(lambda p: loss(p, weights.reshape(-1)), params, directions, 1e-5)
    np.testing.assert_allclose(directions @ gradient, numeric, rtol=2e-3, atol=2e-4 * scale)
    largest = np.argsort(-np.abs(gradient))[:16]
    numeric = central_difference(lambda p: loss(p, weights.reshape(-1)), params, np.eye(params.size)[largest], 1e-5)
    np.testing.assert_allclose(gradient[largest], numeric, rtol=2e-3, atol=2e-4 * scale)
