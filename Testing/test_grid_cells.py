"""A cell grid's corners against its cells (grid.py): the occupancy grid, the latent bricks and the shared page
take each cell's least corner value and each marked cell's corners this way, one axis at a time. They must
agree with the eight corners taken one by one, value for value."""

from __future__ import annotations

import numpy as np
import pytest

from NeuralRaycastLib.grid import least_corner, marked_corners


def least_of_eight(corners: np.ndarray) -> np.ndarray:
    z, y, x = (n - 1 for n in corners.shape)
    least = corners[:-1, :-1, :-1]
    for dz, dy, dx in np.ndindex(2, 2, 2):
        least = np.minimum(least, corners[dz:dz + z, dy:dy + y, dx:dx + x])
    return least


def corners_of_marked(cells: np.ndarray) -> np.ndarray:
    z, y, x = cells.shape
    corners = np.zeros((z + 1, y + 1, x + 1), bool)
    for dz, dy, dx in np.ndindex(2, 2, 2):
        corners[dz:dz + z, dy:dy + y, dx:dx + x] |= cells
    return corners


@pytest.mark.parametrize("cells", [(1, 1, 1), (1, 5, 2), (7, 3, 9), (16, 17, 15)])
def test_each_cells_least_corner_is_that_of_its_eight_corners(cells):
    rng = np.random.default_rng(sum(cells))
    corners = rng.normal(size=tuple(n + 1 for n in cells)).astype(np.float32)
    corners.flat[rng.integers(corners.size)] = np.nan  # a corner the field gave no number: its cells say so
    least = least_corner(corners)
    assert least.shape == cells and least.dtype == np.float32
    np.testing.assert_array_equal(least, least_of_eight(corners))  # NaN where the reference has NaN
    assert np.isnan(least).any()


@pytest.mark.parametrize("cells", [(1, 1, 1), (2, 6, 3), (9, 4, 8)])
def test_the_corners_of_marked_cells_are_every_corner_of_each(cells):
    rng = np.random.default_rng(len(cells) + cells[0])
    for fraction in (0.0, 0.1, 0.5, 1.0):
        marked = rng.random(cells) < fraction
        corners = marked_corners(marked)
        assert corners.shape == tuple(n + 1 for n in cells) and corners.dtype == bool
        np.testing.assert_array_equal(corners, corners_of_marked(marked))
    lone = np.zeros(cells, bool)
    lone[-1, 0, -1] = True  # one cell: exactly its eight corners
    assert marked_corners(lone).sum() == 8
