"""The patch loss: value as metrics.ssim defines it, gradient against finite differences."""

from __future__ import annotations

import numpy as np
import pytest

from NeuralRaycastLib.image_loss import patch_loss_and_gradient, ssim_and_gradient
from NeuralRaycastLib.metrics import ssim


def _patches(seed: int, shape=(3, 16, 16, 4)):
    rng = np.random.default_rng(seed)
    reference = rng.random(shape)
    rendered = np.clip(reference + rng.normal(0, 0.2, shape), 0.02, 0.98)
    return rendered, reference


def test_ssim_value_is_the_metric():
    rendered, reference = _patches(0)
    value, _ = ssim_and_gradient(rendered, reference)
    assert value == pytest.approx(np.mean([ssim(a, b) for a, b in zip(rendered, reference, strict=True)]), abs=1e-9)


@pytest.mark.parametrize("function", ["ssim", "loss"])
def test_gradient_matches_finite_differences(function):
    rendered, reference = _patches(1)

    def value(x):
        return ssim_and_gradient(x, reference)[0] if function == "ssim" else patch_loss_and_gradient(x, reference)[0]

    gradient = (ssim_and_gradient(rendered, reference) if function == "ssim"
                else patch_loss_and_gradient(rendered, reference)[::2])[1]
    rng = np.random.default_rng(2)
    h = 1e-6
    for index in map(tuple, rng.integers(0, rendered.shape, size=(40, 4))):
        plus, minus = rendered.copy(), rendered.copy()
        plus[index] += h
        minus[index] -= h
        numeric = (value(plus) - value(minus)) / (2 * h)
        assert gradient[index] == pytest.approx(numeric, rel=1e-4, abs=1e-9)


def test_loss_terms_and_zero_at_the_reference():
    rendered, reference = _patches(3)
    loss, terms, _ = patch_loss_and_gradient(rendered, reference)
    assert loss == pytest.approx(0.8 * terms["l1"] + 0.2 * terms["dssim"])
    loss0, terms0, _ = patch_loss_and_gradient(reference, reference)
    assert loss0 == pytest.approx(0.0, abs=1e-12) and terms0["dssim"] == pytest.approx(0.0, abs=1e-12)
