"""Order statistics of whole volumes (the brain mask's scale, each channel's robust range) are numpy's, bit for
bit and of the same type, found from the few values near the rank sought."""

from __future__ import annotations

import numpy as np
import pytest

from NeuralRaycastLib.study.order_statistics import percentile


def _volumes():
    rng = np.random.default_rng(11)
    scan = np.asfortranarray(rng.gamma(2.0, 300.0, (40, 50, 30)).astype(np.float32))  # a NIfTI's memory order
    scan[:8] = 0.0  # a background
    yield scan
    yield np.round(rng.standard_normal(120_000) * 3).astype(np.float32)  # ties at every rank
    yield rng.integers(0, 4000, 90_000).astype(np.int16)
    yield rng.integers(0, 255, 70_001).astype(np.uint8)
    yield rng.standard_normal(50_000)
    yield np.zeros(3000, np.float32)
    yield np.array([4.0, -1.0], np.float32)
    yield np.array([7.0], np.float32)
    with_nan = rng.standard_normal(20_000).astype(np.float32)
    with_nan[123] = np.nan
    yield with_nan


@pytest.mark.parametrize("q", [0.0, 0.5, 37.3, 99.0, 99.5, 100.0])
def test_percentile_is_numpys_bit_for_bit(q):
    for volume in _volumes():
        expected = np.percentile(volume, q)
        found = percentile(volume, q)
        assert type(found) is type(expected), (volume.dtype, q)
        np.testing.assert_array_equal(found, expected)
