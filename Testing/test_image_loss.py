"""The patch loss: value as metrics.ssim defines it, gradient against finite differences."""

from __future__ import annotations

import numpy as np
import pytest

from NeuralRaycastLib.render.image_loss import patch_loss_and_gradient, ssim_and_gradient
from NeuralRaycastLib.render.metrics import ssim


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
    from NeuralRaycastLib.render.image_loss import geometry_loss_and_gradient

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
    from NeuralRaycastLib.render.image_loss import geometry_loss_and_gradient

    _sums, targets = _gbuffer(6)
    sums = targets.copy()
    sums[..., 4:7] *= 0.8  # the volume-integrated normal is shorter than a unit normal: only its direction counts
    sums[..., 7] *= sums[..., 3]  # depth sums carry the alpha
    loss, terms, _ = geometry_loss_and_gradient(sums, targets, 1.0, 1.0)
    assert loss == pytest.approx(0.0, abs=1e-12)


def test_albedo_consistency_gradient_and_zero_when_uniform():
    from NeuralRaycastLib.render.image_loss import albedo_consistency_and_gradient

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


# The same loss on the device (shaders/image_loss.slang), in float32 -----------------------------------------

def _rendered_batch(seed: int, patches: int, size: int):
    """Rendered sums and reference G-buffers, (P, size, size, 8), with pixels on either side of the alpha
    threshold in both pictures and a block of zero-length normals."""
    rng = np.random.default_rng(seed)
    shape = (patches, size, size)
    normals = rng.normal(size=(*shape, 3))
    normals /= np.linalg.norm(normals, axis=-1, keepdims=True)
    targets = np.concatenate([rng.random((*shape, 3)), rng.uniform(0.2, 1.0, (*shape, 1)), normals,
                              rng.uniform(20, 30, (*shape, 1))], axis=-1)
    alpha = rng.uniform(0.2, 1.0, shape)
    vectors = alpha[..., None] * rng.normal(size=(*shape, 3))
    vectors[0, 3:7, 4:9] = 0.0
    colours = np.clip(targets[..., :3] + rng.normal(0, 0.2, (*shape, 3)), 0.02, 0.98)
    depths = alpha * (targets[..., 7] + rng.normal(0, 3, shape))
    sums = np.concatenate([colours, alpha[..., None], vectors, depths[..., None]], axis=-1)
    return sums.astype(np.float32), targets


def _device_evaluator(gpu, patches: int, size: int, **weights):
    """The device loss of sums (P, size, size, 8) against fixed targets: sums -> (terms, ∂loss/∂sums)."""
    from NeuralRaycastLib.render.image_loss import DeviceImageLoss
    from NeuralRaycastLib.render.sample_buffers import OUTPUTS, RayBatch

    rays = patches * size * size
    batch = RayBatch(gpu, rays + 40, max_samples=2, structures=1)  # more room than rays, as in training
    loss = DeviceImageLoss(gpu, size)

    def evaluate(sums: np.ndarray, targets: np.ndarray):
        padded = np.zeros((batch.capacity, OUTPUTS), np.float32)
        padded[:rays] = sums.reshape(rays, OUTPUTS)
        batch.sums.copy_from_numpy(padded.reshape(-1))
        terms = loss(batch, targets, **weights)
        return terms, np.asarray(batch.d_sums.to_numpy(), np.float64)[: rays * OUTPUTS].reshape(sums.shape)

    return evaluate


GEOMETRY = {"image_weight": 0.9, "normal_weight": 0.7, "depth_weight": 0.3, "depth_scale_mm": 2.0}


@pytest.mark.gpu
@pytest.mark.parametrize("weights", [{}, GEOMETRY], ids=["image", "image+geometry"])
def test_device_loss_and_gradient_are_the_numpy_ones(gpu, weights):
    from NeuralRaycastLib.render.image_loss import geometry_loss_and_gradient

    sums, targets = _rendered_batch(8, patches=3, size=13)
    alpha = sums[..., 3]
    both = (alpha > 0.5) & (targets[..., 3] > 0.5)
    assert both.any() and not both.all() and (alpha > 0.5).any() and (targets[..., 3] > 0.5).any()

    terms, gradient = _device_evaluator(gpu, 3, 13, **weights)(sums, targets)
    image_weight = weights.get("image_weight", 1.0)
    loss, expected, d_rgba = patch_loss_and_gradient(sums[..., :4], targets[..., :4])
    loss *= image_weight
    reference = np.zeros(sums.shape)
    reference[..., :4] = image_weight * d_rgba
    if weights:
        extra, extra_terms, d_sums = geometry_loss_and_gradient(sums, targets, weights["normal_weight"],
                                                                weights["depth_weight"], weights["depth_scale_mm"])
        loss, reference = loss + extra, reference + d_sums
        expected.update(extra_terms)
        assert extra_terms["normal"] > 0 and extra_terms["depth"] > 0
    assert terms == pytest.approx({"loss": loss, **expected}, rel=1e-5, abs=1e-7)
    assert list(terms) == ["loss", *expected]
    for channel in range(sums.shape[-1]):  # each its own scale
        scale = np.abs(reference[..., channel]).max()
        np.testing.assert_allclose(gradient[..., channel], reference[..., channel], rtol=1e-4, atol=1e-5 * scale,
                                   err_msg=f"channel {channel}")
    if not weights:
        assert np.all(gradient[..., 4:] == 0)
    else:
        assert np.all(gradient[..., 4:][~both] == 0) and np.abs(gradient[..., 4:]).min(axis=(0, 1, 2)).max() == 0


@pytest.mark.gpu
def test_device_gradient_matches_finite_differences_of_the_device_loss(gpu):
    """Central differences of the float32 loss on pixels where every term has a gradient, at steps where
    the float64 reference is smooth (no kink of |·| or of the alpha threshold within the step: its own
    central difference agrees with its gradient) and for derivatives the float32 loss resolves over the
    step (its rounding moves it by about 1e-7)."""
    from NeuralRaycastLib.render.image_loss import geometry_loss_and_gradient

    sums, targets = _rendered_batch(9, patches=2, size=12)
    evaluate = _device_evaluator(gpu, 2, 12, **GEOMETRY)
    _terms, gradient = evaluate(sums, targets)

    def reference(x: np.ndarray) -> tuple[float, np.ndarray]:
        loss, _terms, d_rgba = patch_loss_and_gradient(x[..., :4], targets[..., :4])
        extra, _terms, d_sums = geometry_loss_and_gradient(x, targets, 0.7, 0.3, 2.0)
        d_sums[..., :4] += 0.9 * d_rgba
        return 0.9 * loss + extra, d_sums

    expected = reference(sums)[1]
    every_term = (sums[..., 3] > 0.5) & (targets[..., 3] > 0.5) & (np.abs(sums[..., 4:7]).max(axis=-1) > 0)
    pixels = np.argwhere(every_term)
    rng = np.random.default_rng(10)
    steps = np.array([1e-2] * 7 + [5e-2], np.float32)  # depth sums are tens of mm
    checked = []
    for pick in range(400):
        channel = pick % sums.shape[-1]
        index = (*pixels[rng.integers(len(pixels))], channel)
        if abs(expected[index]) < 1e-4 or sum(i[-1] == channel for i in checked) >= 3:
            continue
        plus, minus = sums.copy(), sums.copy()
        plus[index] += steps[channel]
        minus[index] -= steps[channel]
        h = float(plus[index]) - float(minus[index])
        if abs((reference(plus)[0] - reference(minus)[0]) / h - expected[index]) > 1e-3 * abs(expected[index]):
            continue
        numeric = (evaluate(plus, targets)[0]["loss"] - evaluate(minus, targets)[0]["loss"]) / h
        assert numeric == pytest.approx(gradient[index], rel=5e-3, abs=2e-6), index
        checked.append(index)
    assert len(checked) == 3 * sums.shape[-1], checked


def test_device_loss_window_is_scipys_gaussian():
    """The device SSIM's window (made without scipy, so a run's start need not load it) is the kernel the
    numpy reference filters with: scipy's Gaussian filter of a unit impulse."""
    from scipy import ndimage

    from NeuralRaycastLib.render.image_loss import SSIM_PAD, gaussian_window
    from NeuralRaycastLib.render.metrics import SSIM_SIGMA, SSIM_TRUNCATE

    impulse = np.zeros(2 * SSIM_PAD + 1)
    impulse[SSIM_PAD] = 1.0
    expected = ndimage.gaussian_filter1d(impulse, SSIM_SIGMA, truncate=SSIM_TRUNCATE, mode="constant")
    np.testing.assert_allclose(gaussian_window(), expected, rtol=1e-12, atol=1e-15)
