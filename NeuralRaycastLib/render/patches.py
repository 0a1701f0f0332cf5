"""Training batches of image patches: which views and pixels the differentiable renderer draws each step.

Patches (default 16×16) rather than scattered rays, so the SSIM part of the loss sees local structure.
Patch corners are drawn where the reference view shows something (most of them) or anywhere (the rest,
so empty space is learnt to be empty too). Cameras travel to the device packed as 16 floats each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .camera import Camera

CAMERA_FLOATS = 16  # shaders/ray_samples.slang


def pack_cameras(cameras: list[Camera]) -> np.ndarray:
    packed = np.zeros((len(cameras), CAMERA_FLOATS), np.float32)
    for index, camera in enumerate(cameras):
        right, up, forward = camera.basis()
        packed[index, 0:3] = camera.position
        packed[index, 3:6], packed[index, 6:9], packed[index, 9:12] = right, up, forward
        packed[index, 12] = np.tan(np.radians(camera.view_angle) / 2)
        packed[index, 13:15] = camera.width, camera.height
    return packed


@dataclass
class PatchSampler:
    """Draws (view, x0, y0) patch corners from the training views of reference pictures (V, H, W, C):
    RGBA first (its alpha tells where something is shown), then any other per-pixel targets."""

    reference: np.ndarray
    views: list[int]
    size: int = 16
    foreground_fraction: float = 0.8
    seed: int = 0

    def __post_init__(self) -> None:
        _, height, width, _ = self.reference.shape
        if self.size > min(height, width):
            raise ValueError(f"patch size {self.size} is larger than the images ({width} x {height})")
        self.rng = np.random.default_rng(self.seed)
        last_y, last_x = height - self.size, width - self.size
        corners = []
        for view in self.views:
            alpha = self.reference[view, : last_y + 1, : last_x + 1, 3]
            ys, xs = np.nonzero(alpha > 0.05)
            corners.append(np.stack([xs, ys], axis=1))
        # every view's foreground pixels in one array (view i's from offsets[i], counts[i] of them)
        self.counts = np.array([len(c) for c in corners], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        self.corners = np.concatenate(corners) if self.counts.sum() else np.zeros((0, 2), np.int64)
        self._views = np.asarray(self.views, np.int32)

    def sample(self, count: int) -> np.ndarray:
        """(count, 3) int32 rows of view, x0, y0 (drawn all at once: a training step draws 64)."""
        _, height, width, _ = self.reference.shape
        s = self.size
        picks = self.rng.integers(0, len(self.views), count)
        foreground = (self.rng.random(count) < self.foreground_fraction) & (self.counts[picks] > 0)
        x0 = self.rng.integers(0, width - s + 1, count)
        y0 = self.rng.integers(0, height - s + 1, count)
        chosen = self.offsets[picks] + (self.rng.random(count) * self.counts[picks]).astype(np.int64)
        shown = self.corners[chosen[foreground]]
        x0[foreground], y0[foreground] = shown[:, 0], shown[:, 1]
        rows = np.empty((count, 3), np.int32)
        rows[:, 0] = self._views[picks]
        # centre the patch on the chosen pixel where it fits
        rows[:, 1] = np.clip(x0 - s // 2, 0, width - s)
        rows[:, 2] = np.clip(y0 - s // 2, 0, height - s)
        return rows

    def reference_patches(self, rows: np.ndarray) -> np.ndarray:
        """The reference under each patch, (count, size, size, C)."""
        s = self.size
        return np.stack([self.reference[v, y : y + s, x : x + s] for v, x, y in rows])
