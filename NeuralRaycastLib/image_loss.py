"""The image loss on patches, with its gradient: (1 − λ)·L1 + λ·DSSIM, λ = 0.2 as in 3D Gaussian splatting.

Patches are small (e.g. 16×16) so that SSIM, which compares local statistics, is meaningful on a
random batch of rays. The gradient with respect to the rendered pixels is written out by hand (SSIM's
local means, variances and covariance are Gaussian filters, whose adjoint is the same filter), so it
costs a few filters per step and is checked against finite differences in the tests. The SSIM
definition is metrics.ssim's: an 11×11 Gaussian window (σ = 1.5) and borders excluded.
"""

from __future__ import annotations

import functools

import numpy as np
from scipy import ndimage

from .metrics import SSIM_K1, SSIM_K2, SSIM_SIGMA, SSIM_TRUNCATE

DSSIM_WEIGHT = 0.2


@functools.lru_cache(maxsize=16)
def _blur_matrix(size: int, mode: str) -> np.ndarray:
    """SSIM's Gaussian filter along an axis of ``size`` pixels as a matrix (column j: the filtered unit
    impulse at j), with scipy's boundary ``mode``."""
    matrix = ndimage.gaussian_filter1d(np.eye(size), SSIM_SIGMA, axis=0, truncate=SSIM_TRUNCATE, mode=mode)
    matrix.setflags(write=False)
    return matrix


def _blur(x: np.ndarray, mode: str = "reflect") -> np.ndarray:
    """Gaussian filter over the two pixel axes of (P, H, W, C) patches: two small matrix products (the
    filter is separable and the patches small), the same numbers as ndimage.gaussian_filter."""
    patches, height, width, channels = x.shape
    rows, columns = _blur_matrix(height, mode), _blur_matrix(width, mode)
    x = (rows @ x.reshape(patches, height, width * channels)).reshape(x.shape)
    return np.swapaxes(np.swapaxes(x, 2, 3) @ columns.T, 2, 3)


def ssim_and_gradient(x: np.ndarray, y: np.ndarray, data_range: float = 1.0) -> tuple[float, np.ndarray]:
    """Mean SSIM of patches x against y, (P, H, W, C), and its gradient with respect to x."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    pad = int(SSIM_TRUNCATE * SSIM_SIGMA + 0.5)
    if min(x.shape[1:3]) <= 2 * pad:
        raise ValueError(f"patches must be larger than {2 * pad + 1} pixels for SSIM")
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    mx, my = _blur(x), _blur(y)
    exx, eyy, exy = _blur(x * x), _blur(y * y), _blur(x * y)
    vx, vy, cxy = exx - mx * mx, eyy - my * my, exy - mx * my
    a1, a2 = 2 * mx * my + c1, 2 * cxy + c2
    b1, b2 = mx * mx + my * my + c1, vx + vy + c2
    s = a1 * a2 / (b1 * b2)

    weight = np.zeros_like(s)
    weight[:, pad:-pad, pad:-pad, :] = 1.0
    count = weight.sum()
    weight /= count
    # ∂S/∂(local statistics of x), then the adjoint of the Gaussian (the same filter, zero outside:
    # interior windows never reach past the patch)
    d_mx = (2 * my * a2 - a1 * 2 * my) / (b1 * b2) - s * 2 * mx / b1 + s * 2 * mx / b2
    d_exx = -s / b2
    d_exy = 2 * a1 / (b1 * b2)
    gradient = (
        _blur(weight * d_mx, "constant")
        + 2 * x * _blur(weight * d_exx, "constant")
        + y * _blur(weight * d_exy, "constant")
    )
    return float((s * weight).sum()), gradient


def patch_loss_and_gradient(
    rendered: np.ndarray, reference: np.ndarray, dssim_weight: float = DSSIM_WEIGHT
) -> tuple[float, dict[str, float], np.ndarray]:
    """(loss, its terms, ∂loss/∂rendered) for (P, H, W, C) patches."""
    rendered, reference = np.asarray(rendered, np.float64), np.asarray(reference, np.float64)
    difference = rendered - reference
    l1 = float(np.abs(difference).mean())
    d_l1 = np.sign(difference) / difference.size
    ssim, d_ssim = ssim_and_gradient(rendered, reference)
    dssim = (1.0 - ssim) / 2.0
    loss = (1.0 - dssim_weight) * l1 + dssim_weight * dssim
    gradient = (1.0 - dssim_weight) * d_l1 - dssim_weight * 0.5 * d_ssim
    return loss, {"l1": l1, "dssim": dssim}, gradient


def geometry_loss_and_gradient(
    sums: np.ndarray, targets: np.ndarray, normal_weight: float, depth_weight: float, depth_scale_mm: float = 1.0,
    min_alpha: float = 0.5,
) -> tuple[float, dict[str, float], np.ndarray]:
    """The G-buffer terms of the image loss, (loss, terms, ∂loss/∂sums), for rendered per-ray sums
    (…, 8: r, g, b, a, normal·weight xyz, depth·weight) against the reference's G-buffer (…, 8: RGBA,
    unit normal, depth in mm), on pixels that both show as mostly opaque (alpha > ``min_alpha``):

    - normal (L_norm): mean |n − n_ref|₁ / 3 of the unit volume-integrated normal n = N / |N| against the
      reference normal, the analytic gradient of the boundary maps;
    - depth (L_depth): mean |D / α − depth_ref| / ``depth_scale_mm``, the expected depth along the ray.
    """
    sums, targets = np.asarray(sums, np.float64), np.asarray(targets, np.float64)
    gradient = np.zeros_like(sums)
    alpha = sums[..., 3]
    both = (alpha > min_alpha) & (targets[..., 3] > min_alpha)
    count = max(int(both.sum()), 1)
    terms = {"normal": 0.0, "depth": 0.0}

    if normal_weight:
        vector = sums[..., 4:7]
        length = np.linalg.norm(vector, axis=-1, keepdims=True)
        use = both & (length[..., 0] > 1e-6)
        unit = vector / np.maximum(length, 1e-6)
        sign = np.sign(unit - targets[..., 4:7]) * use[..., None]
        terms["normal"] = float((np.abs(unit - targets[..., 4:7]) * use[..., None]).sum() / (3 * count))
        # d(N/|N|)/dN = (I − u uᵀ) / |N|
        d_unit = sign / (3 * count)
        d_vector = (d_unit - unit * (d_unit * unit).sum(axis=-1, keepdims=True)) / np.maximum(length, 1e-6)
        gradient[..., 4:7] += normal_weight * d_vector

    if depth_weight:
        safe = np.where(both, alpha, 1.0)
        depth = sums[..., 7] / safe
        difference = np.where(both, depth - targets[..., 7], 0.0)
        terms["depth"] = float(np.abs(difference).sum() / (count * depth_scale_mm))
        d_depth = np.sign(difference) / (count * depth_scale_mm)
        gradient[..., 7] += depth_weight * d_depth / safe
        gradient[..., 3] -= depth_weight * d_depth * depth / safe

    loss = normal_weight * terms["normal"] + depth_weight * terms["depth"]
    return loss, terms, gradient


def albedo_consistency_and_gradient(albedo: np.ndarray, weight: np.ndarray) -> tuple[float, np.ndarray]:
    """L_shade, the spread of albedo within each structure: Σ_k Σ_i w_ik ‖a_ik − ā_k‖² / Σ_k Σ_i w_ik, with
    ā_k the w-weighted mean over the batch (w: each sample's optical depth of structure k, so only what is
    seen counts). ``albedo`` (N, K, 3), ``weight`` (N, K). Returns the loss and ∂/∂albedo."""
    albedo, weight = np.asarray(albedo, np.float64), np.asarray(weight, np.float64)
    total = weight.sum()
    if total <= 0:
        return 0.0, np.zeros_like(albedo)
    mean = (weight[..., None] * albedo).sum(axis=0) / np.maximum(weight.sum(axis=0), 1e-30)[:, None]
    deviation = albedo - mean
    loss = float((weight[..., None] * deviation**2).sum() / total)
    # ∂ā/∂a contributes nothing: Σ_i w_ik (a_ik − ā_k) = 0
    return loss, 2.0 * weight[..., None] * deviation / total
