"""Reference views of a study: orbit cameras rendered by the reference raycaster, saved for training
and for looking at (PNG per view, depth and normal pictures, a contact sheet, cameras with their split).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .camera import Camera, orbit_cameras, split_views
from .gpu import GpuContext
from .metrics import contact_sheet, depth_picture, normal_picture, save_png
from .preprocess import PreparedStudy
from .render import ReferenceRenderer, RenderedImage


@dataclass
class ReferenceViews:
    cameras: list[Camera]
    images: list[RenderedImage]
    training: list[int]
    held_out: list[int]


def render_reference_views(
    gpu: GpuContext,
    prepared: PreparedStudy,
    count: int,
    width: int,
    height: int,
    shadows: bool = False,
    view_angle: float = 30.0,
    held_out_every: int = 8,
    progress: Callable[[str, float], None] | None = None,
) -> ReferenceViews:
    report = progress or (lambda message, fraction: None)
    renderer = ReferenceRenderer(gpu, prepared)
    cameras = orbit_cameras(prepared.bounds, count, width, height, view_angle)
    images = []
    for index, camera in enumerate(cameras):
        report(f"view {index + 1}/{count}", index / count)
        images.append(renderer.render(camera, shadows=shadows))
    report("views rendered", 1.0)
    training, held_out = split_views(count, held_out_every)
    return ReferenceViews(cameras, images, training, held_out)


def save_reference_views(views: ReferenceViews, folder: str | Path) -> Path:
    """Write ``views/NNN.png`` (RGBA), ``depth/``, ``normal/``, ``contact_sheet.png``, ``cameras.json``
    and ``reference.npz`` (float arrays: rgba, depth, normal) into ``folder``."""
    folder = Path(folder)
    for index, image in enumerate(views.images):
        rgba = image.rgba.copy()
        alpha = rgba[..., 3:4]
        rgba[..., :3] = np.where(alpha > 0, rgba[..., :3] / np.maximum(alpha, 1e-8), 0.0)  # straight alpha
        save_png(rgba, folder / "views" / f"{index:03d}.png")
        save_png(depth_picture(image.depth), folder / "depth" / f"{index:03d}.png")
        save_png(normal_picture(image.normal), folder / "normal" / f"{index:03d}.png")
    save_png(contact_sheet([image.rgb() for image in views.images]), folder / "contact_sheet.png")
    cameras = [{"index": i, "split": "held_out" if i in views.held_out else "training", **c.to_slicer()}
               for i, c in enumerate(views.cameras)]
    (folder / "cameras.json").write_text(json.dumps({"cameras": cameras}, indent=2) + "\n")
    np.savez_compressed(
        folder / "reference.npz",
        rgba=np.stack([i.rgba for i in views.images]),
        depth=np.stack([i.depth for i in views.images]),
        normal=np.stack([i.normal for i in views.images]),
    )
    return folder
