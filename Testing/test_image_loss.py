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


def _gbuffer(seed: int, shape=(2, 6, 5)):
    rng = np.random.default_rng(seed)
    normals = rng.normal(size=(*shape, 3))
    normals /= np.linalg.norm(normals, axis=-1, keepdims=True)
    targets = np.concatenate([rng.random((*shape, 3)), rng.uniform(0.3, 1.0, (*shape, 1)), normals,
                              rng.uniform(50, 90, (*shape, 1))], axis=-1)
    alpha = rng.uniform(0.3, 1.0, shape)
    sums = np.concatenate([rng.random((*shape, 3)), alpha[..., None], alpha[..., None] * rng.normal(size=(*shape, 3)),
                           (alpha * rng.uniform(50, 90, shape))[..., None]], axis=-1)
    return sums, targets


def test_geometry_terms_gradient_matches_finite_differences():
    from NeuralRaycastLib.image_loss import geometry_loss_and_gradient

    sums, targets = _gbuffer(4)
    loss, terms, gradient = geometry_loss_and_gradient(sums, targets, 0.7, 0.3, depth_scale_mm=2.0)
    assert loss == pytest.approx(0.7 * terms["normal"] + 0.3 * terms["depth"]) and terms["normal"] > 0
    rng = np.random.default_rng(5)
    h = 1e-6
    for index in map(tuple, rng.integers(0, sums.shape, size=(60, 4))):
        if index[-1] == 3 and abs(sums[index] - 0.5) < 1e-3:
            continue  # the alpha threshold is a step
        plus, minus = sums.copy(), sums.copy()
        plus[index] += h
        minus[index] -= h
        numeric = (geometry_loss_and_gradient(plus, targets, 0.7, 0.3, 2.0)[0]
                   - geometry_loss_and_gradient(minus, targets, 0.7, 0.3, 2.0)[0]) / (2 * h)
        assert gradient[index] == pytest.approx(numeric, rel=1e-4, abs=1e-9), index


def test_geometry_terms_vanish_on_the_reference_g_buffer():
    from NeuralRaycastLib.image_loss import geometry_loss_and_gradient

    _sums, targets = _gbuffer(6)
    sums = targets.copy()
    sums[..., 4:7] *= 0.8  # the volume-integrated normal is shorter than a unit normal: only its direction counts
    sums[..., 7] *= sums[..., 3]  # depth sums carry the alpha
    loss, terms, _ = geometry_loss_and_gradient(sums, targets, 1.0, 1.0)
    assert loss == pytest.approx(0.0, abs=1e-12)


def test_albedo_consistency_gradient_and_zero_when_uniform():
    from NeuralRaycastLib.image_loss import albedo_consistency_and_gradient

    rng = np.random.default_rng(7)
    albedo, weight = rng.random((20, 3, 3)), rng.random((20, 3))
    weight[:, 2] = 0.0  # a structure nobody sees adds nothing
    loss, gradient = albedo_consistency_and_gradient(albedo, weight)
    assert loss > 0 and np.all(gradient[:, 2] == 0)
    h = 1e-6
    for index in map(tuple, rng.integers(0, albedo.shape, size=(30, 3))):
        plus, minus = albedo.copy(), albedo.copy()
        plus[index] += h
        minus[index] -= h
        numeric = (albedo_consistency_and_gradient(plus, weight)[0]
                   - albedo_consistency_and_gradient(minus, weight)[0]) / (2 * h)
        assert gradient[index] == pytest.approx(numeric, rel=1e-5, abs=1e-10)
    uniform = np.broadcast_to(rng.random((1, 3, 3)), albedo.shape)
    assert albedo_consistency_and_gradient(uniform, weight)[0] == pytest.approx(0.0, abs=1e-15)
