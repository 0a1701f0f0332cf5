"""MR contrast of tissues relative to white matter (= 1), shared by the phantom and the sample case.

Values are typical relative signal intensities of 1.5-3 T clinical sequences, rounded; they make the
synthetic channels look plausible, nothing more.
"""

from __future__ import annotations

import numpy as np

CHANNELS = ("t1", "t1ce", "t2", "flair")

TISSUE_CONTRAST = {
    "t1": {"gm": 0.72, "wm": 1.0, "csf": 0.35},
    "t1ce": {"gm": 0.74, "wm": 1.0, "csf": 0.38},
    "t2": {"gm": 1.35, "wm": 1.0, "csf": 3.0},
    "flair": {"gm": 1.25, "wm": 1.0, "csf": 0.3},
}

TUMOUR_CONTRAST = {
    "t1": {"necrotic": 0.45, "oedema": 0.80, "enhancing": 0.75},
    "t1ce": {"necrotic": 0.45, "oedema": 0.80, "enhancing": 1.9},
    "t2": {"necrotic": 2.6, "oedema": 2.0, "enhancing": 1.7},
    "flair": {"necrotic": 0.9, "oedema": 1.9, "enhancing": 1.45},
}


def smooth_noise(shape: tuple[int, ...], sigma_voxels: float, rng: np.random.Generator) -> np.ndarray:
    """Gaussian-smoothed white noise, two standard deviations mapped to ±1 and clipped to [-1, 1]."""
    from scipy import ndimage

    noise = ndimage.gaussian_filter(rng.standard_normal(shape), sigma=max(sigma_voxels, 0.5))
    spread = 2.0 * float(noise.std()) or 1.0
    return np.clip(noise / spread, -1.0, 1.0)


def rician_noise(image: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Magnitude of the image plus complex Gaussian noise, as in real MR magnitude images."""
    real = image + sigma * rng.standard_normal(image.shape)
    imaginary = sigma * rng.standard_normal(image.shape)
    return np.sqrt(real * real + imaginary * imaginary)
