"""A rendered view's G-buffer (colour, depth, normals), as both renderers return it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RenderedImage:
    """One rendered view. ``rgba`` is premultiplied; ``depth`` is mm along the ray (0 where empty)."""

    rgba: np.ndarray  # (H, W, 4) float32
    depth: np.ndarray  # (H, W) float32
    normal: np.ndarray  # (H, W, 3) float32, RAS, unit where anything was hit

    def rgb(self, background: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> np.ndarray:
        """Colour composited over a background, (H, W, 3) in [0, 1]."""
        alpha = self.rgba[..., 3:4]
        return np.clip(self.rgba[..., :3] + (1.0 - alpha) * np.asarray(background, np.float32), 0.0, 1.0)


#: Floats per pixel of a frame written as planes (shaders/pixel_planes.slang's storePixel): RGBA, normal,
#: depth.
PLANE_FLOATS = 8


def image_from_planes(planes: np.ndarray, height: int, width: int) -> RenderedImage:
    """A frame's G-buffer written as planes (RGBA, normal, depth; shaders/composite.slang's finishPixel):
    the image's arrays are views of the one read-back array, not copies."""
    pixels = height * width
    planes = np.asarray(planes, np.float32).reshape(-1)
    return RenderedImage(planes[:4 * pixels].reshape(height, width, 4),
                         planes[7 * pixels:8 * pixels].reshape(height, width),
                         planes[4 * pixels:7 * pixels].reshape(height, width, 3))
