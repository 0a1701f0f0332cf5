"""An analytic brain-tumour phantom whose exact signed distances are known at every point.

Shapes are chosen so their signed distance functions are exact (not bounds): the brain is a rounded
box (convex, C¹-smooth), the tumour is three spheres (whole tumour; tumour core; a necrotic core
concentric with the tumour core, so the enhancing shell between them is exact too). The ventricles are
two capsules; they shape the image contrast but are not structures. Like BraTS data, the images are
skull-stripped: everything outside the brain is 0.

The brain is tilted a few degrees against the grid, as a head in a scanner is: a flat face parallel to
the grid would lie at one fixed offset between voxel centres, so the label map would hold nothing about
where within that voxel the face lies (every method that reads labels alone misses it by the same amount).

All coordinates are RAS millimetres; the phantom can be sampled on a grid of any spacing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .contrast import TISSUE_CONTRAST, TUMOUR_CONTRAST, rician_noise, smooth_noise

LABEL_NECROTIC, LABEL_OEDEMA, LABEL_ENHANCING = 1, 2, 3


def sphere_sdf(points: np.ndarray, centre, radius: float) -> np.ndarray:
    return np.linalg.norm(points - np.asarray(centre, dtype=np.float64), axis=-1) - radius


def rounded_box_sdf(points: np.ndarray, centre, half_extent, radius: float) -> np.ndarray:
    """Exact SDF of a box with half-extents ``half_extent`` whose edges are rounded by ``radius``."""
    q = np.abs(points - np.asarray(centre, dtype=np.float64)) - (np.asarray(half_extent, dtype=np.float64) - radius)
    outside = np.linalg.norm(np.maximum(q, 0.0), axis=-1)
    inside = np.minimum(q.max(axis=-1), 0.0)
    return outside + inside - radius


def rotation_xyz(degrees) -> np.ndarray:
    """Rotation by ``degrees`` about x, then y, then z (fixed axes): R = Rz · Ry · Rx."""
    ax, ay, az = np.radians(np.asarray(degrees, dtype=np.float64))
    rx = np.array([[1, 0, 0], [0, np.cos(ax), -np.sin(ax)], [0, np.sin(ax), np.cos(ax)]])
    ry = np.array([[np.cos(ay), 0, np.sin(ay)], [0, 1, 0], [-np.sin(ay), 0, np.cos(ay)]])
    rz = np.array([[np.cos(az), -np.sin(az), 0], [np.sin(az), np.cos(az), 0], [0, 0, 1]])
    return rz @ ry @ rx


def capsule_sdf(points: np.ndarray, a, b, radius: float) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    pa, ba = points - a, b - a
    h = np.clip((pa @ ba) / (ba @ ba), 0.0, 1.0)
    return np.linalg.norm(pa - h[..., None] * ba, axis=-1) - radius


@dataclass(frozen=True)
class Phantom:
    """Geometry of the phantom (millimetres, RAS)."""

    brain_centre: tuple[float, float, float] = (0.0, -8.0, 6.0)
    brain_half_extent: tuple[float, float, float] = (66.0, 82.0, 58.0)
    brain_rounding: float = 38.0
    brain_tilt_degrees: tuple[float, float, float] = (8.0, -6.0, 12.0)  # about R, A and S
    cortex_thickness: float = 3.0
    tumour_centre: tuple[float, float, float] = (30.0, 12.0, 16.0)
    core_radius: float = 13.0
    necrotic_radius: float = 7.0
    whole_offset: tuple[float, float, float] = (3.0, -2.0, 2.0)
    whole_radius: float = 23.0
    ventricle_radius: float = 5.0

    def sdf(self, name: str, points: np.ndarray) -> np.ndarray:
        """Exact signed distance (mm, negative inside) of structure ``name`` at RAS ``points`` (..., 3)."""
        points = np.asarray(points, dtype=np.float64)
        if name == "brain":  # the box in its own axes (a rotation keeps distances exact)
            local = (points - self.brain_centre) @ self.brain_axes() + self.brain_centre
            return rounded_box_sdf(local, self.brain_centre, self.brain_half_extent, self.brain_rounding)
        core = sphere_sdf(points, self.tumour_centre, self.core_radius)
        if name == "tumor_core":
            return core
        if name == "whole_tumor":
            return sphere_sdf(points, np.add(self.tumour_centre, self.whole_offset), self.whole_radius)
        if name == "enhancing_tumor":
            return np.maximum(core, -sphere_sdf(points, self.tumour_centre, self.necrotic_radius))
        if name == "necrotic":
            return sphere_sdf(points, self.tumour_centre, self.necrotic_radius)
        if name == "ventricles":
            c, axes = np.asarray(self.brain_centre), self.brain_axes()  # they tilt with the brain
            left = capsule_sdf(points, c + axes @ (-9, -20, 2), c + axes @ (-7, 22, 8), self.ventricle_radius)
            right = capsule_sdf(points, c + axes @ (9, -20, 2), c + axes @ (7, 22, 8), self.ventricle_radius)
            return np.minimum(left, right)
        raise KeyError(f"the phantom has no structure '{name}'")

    structure_names = ("brain", "whole_tumor", "tumor_core", "enhancing_tumor")

    def brain_axes(self) -> np.ndarray:
        """The brain box's axes in RAS (columns)."""
        return rotation_xyz(self.brain_tilt_degrees)

    def bounds(self, margin: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """RAS corners (low, high) of a box that holds the brain, widened by ``margin`` mm."""
        # The rounded box is its inner box grown by a ball of the rounding radius.
        inner = np.asarray(self.brain_half_extent) - self.brain_rounding
        half = np.abs(self.brain_axes()) @ inner + self.brain_rounding + margin
        return np.asarray(self.brain_centre) - half, np.asarray(self.brain_centre) + half

    def grid(self, spacing) -> tuple[np.ndarray, tuple[int, int, int]]:
        """An axis-aligned RAS grid of ``spacing`` mm (one number, or one per axis: thick slices) that holds the
        brain with a 6 mm margin: (affine, shape)."""
        low, high = self.bounds(6.0)
        spacing = np.broadcast_to(np.asarray(spacing, np.float64), (3,))
        shape = tuple(int(np.ceil((h - lo) / s)) + 1 for lo, h, s in zip(low, high, spacing, strict=True))
        affine = np.diag([*spacing, 1.0])
        affine[:3, 3] = low
        return affine, shape  # type: ignore[return-value]


def voxel_centres(affine: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
    """RAS coordinates of every voxel centre, shape (I, J, K, 3)."""
    ijk = np.stack(np.meshgrid(*[np.arange(n, dtype=np.float64) for n in shape], indexing="ij"), axis=-1)
    return ijk @ affine[:3, :3].T + affine[:3, 3]


def _inside_fraction(sdf: np.ndarray, spacing: float) -> np.ndarray:
    """Partial volume: the fraction of a voxel inside a surface, a linear ramp one voxel (``spacing``) wide."""
    return np.clip(0.5 - sdf / spacing, 0.0, 1.0)


def render_phantom(phantom: Phantom, spacing=2.0, seed: int = 0):
    """Sample the phantom on a grid of ``spacing`` mm (one number, or one per axis): (channels {name: float32
    array}, labels int16 array, affine). On thick slices the partial-volume ramp is a voxel's mean side wide."""
    affine, shape = phantom.grid(spacing)
    spacing = float(np.cbrt(np.prod(np.broadcast_to(np.asarray(spacing, np.float64), (3,)))))
    points = voxel_centres(affine, shape)
    rng = np.random.default_rng(seed)

    brain = phantom.sdf("brain", points)
    fractions = {
        "brain": _inside_fraction(brain, spacing),
        "deep": _inside_fraction(brain + phantom.cortex_thickness, spacing),
        "csf": _inside_fraction(phantom.sdf("ventricles", points), spacing),
        "whole": _inside_fraction(phantom.sdf("whole_tumor", points), spacing),
        "core": _inside_fraction(phantom.sdf("tumor_core", points), spacing),
        "necrotic": _inside_fraction(phantom.sdf("necrotic", points), spacing),
    }
    f = fractions
    normal = 1.0 - f["whole"]
    weights = {
        "gm": normal * (1.0 - f["csf"]) * (1.0 - f["deep"]),
        "wm": normal * (1.0 - f["csf"]) * f["deep"],
        "csf": normal * f["csf"],
        "necrotic": f["necrotic"],
        "enhancing": f["core"] - f["necrotic"],
        "oedema": f["whole"] - f["core"],
    }
    texture = 1.0 + 0.06 * smooth_noise(shape, sigma_voxels=6.0 / spacing, rng=rng)
    channels = {}
    for channel in ("t1", "t1ce", "t2", "flair"):
        value = sum(weights[t] * TISSUE_CONTRAST[channel][t] for t in ("gm", "wm", "csf"))
        value = value + sum(weights[t] * TUMOUR_CONTRAST[channel][t] for t in ("necrotic", "enhancing", "oedema"))
        image = f["brain"] * value * texture
        channels[channel] = (1000.0 * rician_noise(image, 0.02, rng) * (f["brain"] > 0)).astype(np.float32)

    labels = np.zeros(shape, dtype=np.int16)
    labels[phantom.sdf("whole_tumor", points) < 0] = LABEL_OEDEMA
    labels[phantom.sdf("tumor_core", points) < 0] = LABEL_ENHANCING
    labels[phantom.sdf("necrotic", points) < 0] = LABEL_NECROTIC
    return channels, labels, affine
