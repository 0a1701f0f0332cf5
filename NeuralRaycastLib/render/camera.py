"""Pinhole cameras in RAS millimetres, orbit sets around a study, and Slicer camera conversion.

A camera is what Slicer's ``vtkMRMLCameraNode`` holds: position, focal point, view-up and the vertical
view angle in degrees, plus an image size. Rays go through pixel centres; row 0 is the top of the image
(shaders/camera.slang generates them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: The sides of a view, in pixels, that a run or a render accepts: from one training patch (16 pixels) to
#: what a GPU renders in a fraction of a second and keeps in memory. A camera itself allows sides below the
#: minimum (small test pictures), never above the maximum: a larger picture is refused before it is allocated.
MIN_VIEW_SIZE = 16
MAX_VIEW_SIZE = 4096


def check_view_size(width: int, height: int) -> None:
    """Refuse a view size outside :data:`MIN_VIEW_SIZE` to :data:`MAX_VIEW_SIZE` pixels a side (ValueError)."""
    if not (MIN_VIEW_SIZE <= width <= MAX_VIEW_SIZE and MIN_VIEW_SIZE <= height <= MAX_VIEW_SIZE):
        raise ValueError(f"view size {width} x {height} pixels is outside the supported range: each side from "
                         f"{MIN_VIEW_SIZE} to {MAX_VIEW_SIZE} pixels")


def _unit(vector: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vector))
    if norm < 1e-12:
        raise ValueError("degenerate camera: zero-length direction")
    return vector / norm


@dataclass(frozen=True)
class Camera:
    position: tuple[float, float, float]
    focal_point: tuple[float, float, float]
    view_up: tuple[float, float, float]
    view_angle: float  # vertical field of view in degrees
    width: int
    height: int

    def __post_init__(self) -> None:
        if not 0.0 < self.view_angle < 180.0:
            raise ValueError(f"view angle must lie in (0, 180) degrees, got {self.view_angle}")
        if self.width < 1 or self.height < 1:
            raise ValueError(f"image size must be positive, got {self.width} x {self.height}")
        if max(self.width, self.height) > MAX_VIEW_SIZE:
            check_view_size(self.width, self.height)
        forward = np.subtract(self.focal_point, self.position)
        if abs(float(np.dot(_unit(forward), _unit(np.asarray(self.view_up, float))))) > 0.999:
            raise ValueError("degenerate camera: view-up is parallel to the viewing direction")

    def basis(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Orthonormal (right, up, forward) in RAS; up is view-up made orthogonal to forward."""
        forward = _unit(np.subtract(self.focal_point, self.position).astype(np.float64))
        right = _unit(np.cross(forward, np.asarray(self.view_up, dtype=np.float64)))
        up = np.cross(right, forward)
        return right, up, forward

    def ray_directions(self) -> np.ndarray:
        """Unit ray directions for every pixel, shape (height, width, 3): the same rule as the shader."""
        right, up, forward = self.basis()
        tan_half = np.tan(np.radians(self.view_angle) / 2)
        x = ((np.arange(self.width) + 0.5) / self.width * 2 - 1) * tan_half * self.width / self.height
        y = (1 - (np.arange(self.height) + 0.5) / self.height * 2) * tan_half
        directions = forward + x[None, :, None] * right + y[:, None, None] * up
        return directions / np.linalg.norm(directions, axis=-1, keepdims=True)

    def to_shader(self) -> dict[str, Any]:
        import slangpy as spy

        right, up, forward = self.basis()
        return {
            "position": spy.float3(*map(float, self.position)),
            "right": spy.float3(*map(float, right)),
            "up": spy.float3(*map(float, up)),
            "forward": spy.float3(*map(float, forward)),
            "tanHalfFovY": float(np.tan(np.radians(self.view_angle) / 2)),
            "size": spy.int2(self.width, self.height),
        }

    # --- Slicer -------------------------------------------------------------------------------------

    def to_slicer(self) -> dict[str, Any]:
        """Values for ``vtkMRMLCameraNode`` (SetPosition, SetFocalPoint, SetViewUp, SetViewAngle) and the view size."""
        return {
            "position": tuple(map(float, self.position)),
            "focal_point": tuple(map(float, self.focal_point)),
            "view_up": tuple(map(float, self.basis()[1])),
            "view_angle": float(self.view_angle),
            "size": (self.width, self.height),
        }

    @classmethod
    def from_slicer(
        cls, position, focal_point, view_up, view_angle: float, size: tuple[int, int]
    ) -> Camera:
        """From a Slicer camera node's values and the 3D view's size in pixels (width, height), which must lie
        within :func:`check_view_size`'s limits."""
        check_view_size(int(size[0]), int(size[1]))
        return cls(
            tuple(map(float, position)),
            tuple(map(float, focal_point)),
            tuple(map(float, view_up)),
            float(view_angle),
            int(size[0]),
            int(size[1]),
        )


def framing_distance(radius: float, view_angle: float, width: int, height: int, margin: float = 1.08) -> float:
    """Distance at which a sphere of ``radius`` fills the narrower side of the image (with a margin)."""
    half = np.radians(view_angle) / 2
    half_narrow = half if width >= height else np.arctan(np.tan(half) * width / height)
    return float(margin * radius / np.sin(half_narrow))


def orbit_cameras(
    bounds: np.ndarray,
    count: int,
    width: int,
    height: int,
    view_angle: float = 30.0,
    elevation_range: tuple[float, float] = (-45.0, 75.0),
    margin: float = 1.1,
) -> list[Camera]:
    """``count`` cameras looking at the centre of ``bounds`` from directions spread evenly (a Fibonacci
    spiral) over the band of elevations, at a distance that frames the whole box. Deterministic. Every run's
    views and every render's cameras come from here: the size is checked here (:func:`check_view_size`).

    Elevation is measured from the axial plane towards Superior; view-up is Superior except near the
    poles, where it is Anterior.
    """
    if count < 1:
        raise ValueError("need at least one view")
    check_view_size(width, height)
    low, high = np.asarray(bounds, dtype=np.float64)
    centre = (low + high) / 2
    radius = float((high - low).max() / 2)  # the sphere around an ellipsoid inscribed in the box
    distance = framing_distance(radius, view_angle, width, height, margin)
    z_low, z_high = np.sin(np.radians(elevation_range))
    golden = np.pi * (3.0 - np.sqrt(5.0))
    cameras = []
    for index in range(count):
        z = z_high - (index + 0.5) / count * (z_high - z_low)  # uniform in z = uniform area on the sphere
        ring = np.sqrt(max(0.0, 1.0 - z * z))
        azimuth = index * golden
        direction = np.array([ring * np.cos(azimuth), ring * np.sin(azimuth), z])
        up = (0.0, 0.0, 1.0) if abs(z) < 0.98 else (0.0, 1.0, 0.0)
        position = centre + distance * direction
        cameras.append(Camera(tuple(position), tuple(centre), up, view_angle, width, height))
    return cameras


def split_views(count: int, held_out_every: int = 8) -> tuple[list[int], list[int]]:
    """Deterministic split of view indices: every ``held_out_every``-th view (starting at 3) is held out."""
    if held_out_every < 2:
        raise ValueError("held_out_every must be at least 2")
    held_out = [i for i in range(count) if i % held_out_every == 3 % held_out_every]
    training = [i for i in range(count) if i not in held_out]
    return training, held_out


def check_view_split(count: int | None, held_out_every: int) -> None:
    """Refuse a number of views and a split that leave no held-out view to score a training by, or no view to
    train on (ValueError with the limits); a ``count`` of None checks the split alone."""
    if held_out_every < 2:
        raise ValueError(f"held-out-every must be at least 2 (got {held_out_every})")
    least = max(2, 3 % held_out_every + 1)  # the first held-out view is view 3 % held_out_every
    if count is not None and count < least:
        raise ValueError(f"views must be at least {least} when one view in {held_out_every} is held out "
                         f"(got {count}): at least one view is held out for evaluation and one trains")
