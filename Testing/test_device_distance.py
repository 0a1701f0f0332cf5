"""The device's exact distance transform (shaders/distance_transform.slang) gives the CPU's values: against a
brute-force search, against the ``edt`` package the boundary maps use without a device, for masks that are empty
or fill the grid, and along lines longer than any fixed per-thread array would hold."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from NeuralRaycastLib.study.device_distance import distance_transform, squared_distance_transform

ANISOTROPIC = (0.7, 1.3, 2.1)


def brute_force_squared(inside: np.ndarray, spacing) -> np.ndarray:
    """Squared mm to the nearest voxel not in ``inside``, by looking at every one (inf where there is none)."""
    outside = np.argwhere(~inside) * np.asarray(spacing)
    points = np.array(list(itertools.product(*map(range, inside.shape)))) * np.asarray(spacing)
    if not len(outside):
        return np.full(inside.shape, np.inf)
    squared = ((points[:, None, :] - outside[None, :, :]) ** 2).sum(axis=2).min(axis=1)
    return squared.reshape(inside.shape)


@pytest.mark.parametrize("shape, fraction", [((6, 7, 5), 0.6), ((9, 5, 4), 0.9), ((1, 1, 12), 0.8)])
def test_squared_distances_are_the_brute_force_ones(gpu, shape, fraction):
    inside = np.random.default_rng(3).random(shape) < fraction
    inside.flat[0] = False  # at least one voxel outside
    squared = squared_distance_transform(gpu, inside, ANISOTROPIC)
    assert squared.dtype == np.float32 and squared.shape == shape
    np.testing.assert_allclose(squared, brute_force_squared(inside, ANISOTROPIC), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("shape, fraction, spacing", [
    ((23, 17, 19), 0.97, ANISOTROPIC),
    ((20, 21, 22), 0.995, (0.5, 0.5, 5.0)),  # a thin-sliced scan: few voxels outside, far apart
    ((300, 3, 2), 0.99, (1.0, 2.0, 3.0)),  # long lines along the last pass
    ((2, 3, 300), 0.99, (3.0, 2.0, 1.0)),  # and along the first
])
def test_distances_are_the_edt_package_ones(gpu, shape, fraction, spacing):
    edt = pytest.importorskip("edt")
    inside = np.random.default_rng(5).random(shape) < fraction
    inside.flat[-1] = False
    expected = edt.edt(inside, anisotropy=spacing, black_border=False)
    distance = distance_transform(gpu, inside, spacing)
    assert np.isfinite(distance).all()
    np.testing.assert_allclose(distance, expected, rtol=1e-6, atol=1e-6)


def test_empty_and_full_masks(gpu):
    """No voxel inside: all 0. Every voxel inside: no voxel to reach, infinite, as the CPU transforms say."""
    empty = np.zeros((4, 5, 6), bool)
    assert np.array_equal(distance_transform(gpu, empty, ANISOTROPIC), np.zeros(empty.shape, np.float32))
    full = distance_transform(gpu, ~empty, ANISOTROPIC)
    assert np.isinf(full).all() and (full > 0).all()


def test_a_fortran_ordered_mask_is_read_in_its_index_order(gpu):
    """NIfTI volumes come in Fortran order; the transform follows the [i, j, k] indices, not the memory."""
    inside = np.asfortranarray(np.random.default_rng(7).random((7, 9, 11)) < 0.8)
    inside[3, 4, 5] = False
    expected = np.sqrt(brute_force_squared(inside, ANISOTROPIC)).astype(np.float32)
    np.testing.assert_allclose(distance_transform(gpu, inside, ANISOTROPIC), expected, rtol=2e-6, atol=1e-6)
