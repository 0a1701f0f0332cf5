"""The image loss on patches, with its gradient: (1 − λ)·L1 + λ·DSSIM, λ = 0.2 as in 3D Gaussian splatting.

Patches are small (e.g. 16×16) so that SSIM, which compares local statistics, is meaningful on a
random batch of rays. The gradient with respect to the rendered pixels is written out by hand (SSIM's
local means, variances and covariance are Gaussian filters, whose adjoint is the same filter), so it
costs a few filters per step and is checked against finite differences in the tests. The SSIM
definition is metrics.ssim's: an 11×11 Gaussian window (σ = 1.5) and borders excluded.

Training computes the same loss and gradient on the device (:class:`DeviceImageLoss`,
shaders/image_loss.slang), beside the rendered sums; the numpy functions here define it (in float64) and
are what the device is tested against.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from ..gpu.device import device_memory
from .metrics import SSIM_K1, SSIM_K2, SSIM_SIGMA, SSIM_TRUNCATE
from .sample_buffers import OUTPUTS, RayBatch  # OUTPUTS: floats per pixel of the rendered sums and references

if TYPE_CHECKING:
    from ..gpu.device import GpuContext

DSSIM_WEIGHT = 0.2
SSIM_PAD = int(SSIM_TRUNCATE * SSIM_SIGMA + 0.5)  # the window's radius; SSIM's mean leaves out this border


def gaussian_window() -> np.ndarray:
    """SSIM's Gaussian weights, 2·SSIM_PAD + 1 of them: scipy's 1-D Gaussian filter kernel (normalised
    exp(-x²/2σ²)), computed without loading scipy."""
    x = np.arange(-SSIM_PAD, SSIM_PAD + 1, dtype=np.float64)
    weights = np.exp(-0.5 * (x / SSIM_SIGMA) ** 2)
    return weights / weights.sum()


@functools.lru_cache(maxsize=16)
def _blur_matrix(size: int, mode: str) -> np.ndarray:
    """SSIM's Gaussian filter along an axis of ``size`` pixels as a matrix (column j: the filtered unit
    impulse at j), with scipy's boundary ``mode``."""
    from scipy import ndimage

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
    pad = SSIM_PAD
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


#: What shaders/image_loss.slang sums per batch (its TERM_* order): Σ|x − y| over RGBA, Σ SSIM away from the
#: edges, the pixels opaque in both pictures, and the normal and depth terms' sums over those pixels.
DEVICE_TERMS = ("l1", "ssim", "mask", "normal", "depth")
_ADJOINTS = 12  # floats per pixel between the shader's passes
#: Device memory a pixel of a training batch's patches takes in the loss: its reference, the adjoints, each
#: term's share (DeviceImageLoss._allocate).
LOSS_BYTES_PER_PIXEL = 4 * (OUTPUTS + _ADJOINTS + len(DEVICE_TERMS))


class DeviceImageLoss:
    """The image loss of a batch of (P, size, size) patches (:func:`patch_loss_and_gradient` with
    :func:`geometry_loss_and_gradient`) computed on the device, where the rendered sums are: ∂loss/∂sums
    goes straight into the batch's ``d_sums`` for the composite backward, the reference patches go up and
    only the loss terms come back (in float32 throughout; the numpy functions are the reference)."""

    def __init__(self, gpu: GpuContext, patch_size: int, dssim_weight: float = DSSIM_WEIGHT,
                 min_alpha: float = 0.5) -> None:
        import slangpy as spy

        if patch_size <= 2 * SSIM_PAD + 1:
            raise ValueError(f"patches must be larger than {2 * SSIM_PAD + 1} pixels for SSIM")
        self.gpu, self.size = gpu, patch_size
        self.dssim_weight, self.min_alpha = dssim_weight, min_alpha
        self.module = gpu.load_module("image_loss")
        window = gaussian_window()
        self._window = spy.Tensor.from_numpy(gpu.device, np.ascontiguousarray(window, np.float32))
        self._totals = spy.Tensor.zeros(gpu.device, shape=(len(DEVICE_TERMS),), dtype="float")
        self._patches = 0

    def _allocate(self, patches: int) -> None:
        """Buffers for ``patches`` patches (kept while the batch keeps its size, as in training)."""
        import slangpy as spy

        device, pixels = self.gpu.device, patches * self.size**2
        self._reference = self._adjoints = self._shares = self._patch_sums = None  # another size's, freed first
        self._patches = 0
        with device_memory(f"the image loss of {patches} patches"):
            self._reference = spy.Tensor.zeros(device, shape=(pixels * OUTPUTS,), dtype="float")
            self._adjoints = spy.Tensor.zeros(device, shape=(pixels * _ADJOINTS,), dtype="float")
            self._shares = spy.Tensor.zeros(device, shape=(pixels * len(DEVICE_TERMS),), dtype="float")
            self._patch_sums = spy.Tensor.zeros(device, shape=(patches * len(DEVICE_TERMS),), dtype="float")
        self._patches = patches

    def __call__(self, batch: RayBatch, reference: np.ndarray, image_weight: float = 1.0,
                 normal_weight: float = 0.0, depth_weight: float = 0.0,
                 depth_scale_mm: float = 1.0) -> dict[str, float]:
        """The loss of the batch's first P·size² rays (patch after patch, rows of ``size``) against
        ``reference`` (P, size, size, 8: RGBA, unit normal, depth in mm), ∂loss/∂sums written to
        ``batch.d_sums``. Returns ``loss``, ``l1``, ``dssim`` and, where a geometry weight is not zero,
        ``normal`` and ``depth``, as the numpy functions do."""
        import slangpy as spy

        reference = np.ascontiguousarray(reference, np.float32)
        patches, size = len(reference), self.size
        if reference.shape != (patches, size, size, OUTPUTS):
            raise ValueError(f"reference patches of shape {reference.shape}, expected (P, {size}, {size}, 8)")
        pixels = patches * size * size
        if batch.sums.shape[0] < pixels * OUTPUTS:
            raise ValueError(f"the batch holds fewer than the {pixels} rays of {patches} patches")
        if patches != self._patches:
            self._allocate(patches)
        self._reference.copy_from_numpy(reference.reshape(-1))
        buffers = {
            "sums": batch.sums.storage.device_address,
            "reference": self._reference.storage.device_address,
            "window": self._window.storage.device_address,
            "adjoints": self._adjoints.storage.device_address,
            "shares": self._shares.storage.device_address,
            "patchSums": self._patch_sums.storage.device_address,
            "totals": self._totals.storage.device_address,
            "gradient": batch.d_sums.storage.device_address,
            "size": size,
            "radius": SSIM_PAD,
            "patches": patches,
        }
        inner = size - 2 * SSIM_PAD
        c1, c2 = SSIM_K1**2, SSIM_K2**2  # data range 1
        settings = {
            "imageWeight": image_weight, "dssimWeight": self.dssim_weight, "normalWeight": normal_weight,
            "depthWeight": depth_weight, "depthScale": depth_scale_mm, "minAlpha": self.min_alpha,
            "c1": c1, "c2": c2, "l1Mean": 1.0 / (pixels * 4), "ssimMean": 1.0 / (patches * inner * inner * 4),
        }
        self.module.imageLossPixel(spy.grid((pixels,)), buffers, settings)
        self.module.imageLossPatchSums(spy.grid((patches * len(DEVICE_TERMS),)), buffers)
        self.module.imageLossGradient(spy.grid((pixels,)), buffers, settings)
        totals = dict(zip(DEVICE_TERMS, np.asarray(self._totals.to_numpy(), np.float64), strict=True))

        l1 = float(totals["l1"] * settings["l1Mean"])
        dssim = float((1.0 - totals["ssim"] * settings["ssimMean"]) / 2.0)
        terms = {"l1": l1, "dssim": dssim}
        loss = image_weight * ((1.0 - self.dssim_weight) * l1 + self.dssim_weight * dssim)
        if normal_weight or depth_weight:
            count = max(float(totals["mask"]), 1.0)
            terms["normal"] = float(totals["normal"] / (3 * count)) if normal_weight else 0.0
            terms["depth"] = float(totals["depth"] / (count * depth_scale_mm)) if depth_weight else 0.0
            loss += normal_weight * terms["normal"] + depth_weight * terms["depth"]
        return {"loss": float(loss), **terms}
