"""Image metrics (PSNR, SSIM, DSSIM, L1) and picture files (PNG, contact sheets).

SSIM follows Wang et al. 2004 as commonly computed: an 11×11 Gaussian window (σ = 1.5, truncated at
3.5 σ), K1 = 0.01, K2 = 0.03, population (not sample) covariances, borders of 5 pixels excluded, the mean
over pixels and channels. It agrees with scikit-image's ``structural_similarity(gaussian_weights=True,
sigma=1.5, use_sample_covariance=False, data_range=...)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SSIM_SIGMA = 1.5
SSIM_TRUNCATE = 3.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def _as_float(image: np.ndarray) -> np.ndarray:
    image = np.asarray(image, dtype=np.float64)
    return image[..., None] if image.ndim == 2 else image


def l1(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(np.abs(_as_float(a) - _as_float(b))))


def psnr(a: np.ndarray, b: np.ndarray, data_range: float = 1.0) -> float:
    mse = float(np.mean((_as_float(a) - _as_float(b)) ** 2))
    return float("inf") if mse == 0.0 else float(10.0 * np.log10(data_range**2 / mse))


def ssim_map(a: np.ndarray, b: np.ndarray, data_range: float = 1.0) -> np.ndarray:
    """Per-pixel SSIM, (H, W, C), over the full image (borders included; see :func:`ssim`)."""
    a, b = _as_float(a), _as_float(b)
    if a.shape != b.shape:
        raise ValueError(f"images differ in shape: {a.shape} vs {b.shape}")
    from scipy import ndimage  # on first use: importing this module stays cheap

    def blur(x: np.ndarray) -> np.ndarray:
        return ndimage.gaussian_filter(x, sigma=(SSIM_SIGMA, SSIM_SIGMA, 0), truncate=SSIM_TRUNCATE, mode="reflect")

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a * mu_a
    var_b = blur(b * b) - mu_b * mu_b
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    return ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))


def ssim(a: np.ndarray, b: np.ndarray, data_range: float = 1.0) -> float:
    pad = int(SSIM_TRUNCATE * SSIM_SIGMA + 0.5)
    values = ssim_map(a, b, data_range)
    if min(values.shape[:2]) <= 2 * pad:
        raise ValueError(f"images must be at least {2 * pad + 1} pixels on each side for SSIM")
    return float(values[pad:-pad, pad:-pad].mean())


def dssim(a: np.ndarray, b: np.ndarray, data_range: float = 1.0) -> float:
    """Structural dissimilarity (1 - SSIM) / 2, in [0, 1]."""
    return (1.0 - ssim(a, b, data_range)) / 2.0


def to_uint8(image: np.ndarray) -> np.ndarray:
    return (np.clip(np.asarray(image, dtype=np.float64), 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


#: zlib's fastest level, for pictures written while the user waits (a run's reference views): the sample's 24 views
#: of 512² are written in about a quarter of the default level's time, in files a fifth larger (BENCHMARKS.md).
FAST_PNG = 1


def save_png(image: np.ndarray, path: str | Path, compress_level: int = 6) -> Path:
    """Save an image ((H, W), (H, W, 3) or (H, W, 4): floats in [0, 1], or bytes as they are) as PNG, atomically
    (files.py); ``compress_level`` as zlib's (6: PIL's default; :data:`FAST_PNG`)."""
    from PIL import Image

    from ..files import atomic_file

    path = Path(path)
    image = np.asarray(image)
    picture = Image.fromarray(image if image.dtype == np.uint8 else to_uint8(image))
    with atomic_file(path) as handle:
        picture.save(handle, format="PNG", compress_level=compress_level)
    return path


def contact_sheet(images: list[np.ndarray], columns: int | None = None, gap: int = 2) -> np.ndarray:
    """Tile same-sized images into one picture (row-major, ``gap`` pixels of black between), of the first image's
    type."""
    if not images:
        raise ValueError("no images for a contact sheet")
    first = np.asarray(images[0])
    columns = columns or int(np.ceil(np.sqrt(len(images))))
    rows = int(np.ceil(len(images) / columns))
    height, width = first.shape[:2]
    sheet = np.zeros((rows * height + (rows - 1) * gap, columns * width + (columns - 1) * gap, *first.shape[2:]),
                     first.dtype)
    for index, image in enumerate(images):
        r, c = divmod(index, columns)
        sheet[r * (height + gap): r * (height + gap) + height, c * (width + gap): c * (width + gap) + width] = image
    return sheet


def depth_picture(depth: np.ndarray) -> np.ndarray:
    """Depth as grey (near = bright), empty pixels black: for looking at, not measuring."""
    hit = depth > 0
    if not hit.any():
        return np.zeros(depth.shape)
    near, far = np.percentile(depth[hit], [1, 99])
    return np.where(hit, 1.0 - 0.8 * np.clip((depth - near) / max(far - near, 1e-6), 0, 1), 0.0)


def normal_picture(normal: np.ndarray) -> np.ndarray:
    """Normals (RAS) as colours: (n + 1) / 2, empty pixels black."""
    hit = np.linalg.norm(normal, axis=-1, keepdims=True) > 0
    return np.where(hit, (normal + 1.0) / 2.0, 0.0)
