"""Reference views of a study: orbit cameras rendered by the reference raycaster, saved for training
and for looking at (PNG per view, depth and normal pictures, a contact sheet, cameras with their split).

Rendered views are also kept on disk, keyed by everything that decides their pixels (the prepared
study's inputs, cameras, style, backend and the Slang sources), so a second run on the same study starts
training without rendering them again.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..array_cache import read_entry, write_entry
from ..files import atomic_file, atomic_folder, check_replaceable, write_text
from ..gpu.device import GpuContext
from ..paths import cache_folder, shader_sources_digest
from ..progress import Progress
from ..study.preprocess import PreparedStudy
from ..study.study import map_in_threads
from .camera import Camera, orbit_cameras, split_views
from .image import RenderedImage
from .metrics import FAST_PNG, contact_sheet, depth_picture, normal_picture, psnr, save_png, ssim, to_uint8
from .reference_render import ReferenceRenderer
from .style import RenderStyle

#: Bump when what a cached set of views holds changes.
VIEW_CACHE_VERSION = 1
#: Sets of views kept on disk; the least recently used go first.
VIEW_CACHE_ENTRIES = 8


@dataclass
class ReferenceViews:
    cameras: list[Camera]
    images: list[RenderedImage]
    training: list[int]
    held_out: list[int]

    def targets(self) -> np.ndarray:
        """Every view's G-buffer as one (V, H, W, 8) float32 array: RGBA, normal xyz, depth (the renderer's
        outputs, channel for channel). Filled one view per thread: for 24 views of 512² that is 200 MB, which
        a stack of concatenations would copy twice in one thread, far more slowly."""
        first = self.images[0]
        out = np.empty((len(self.images), *first.depth.shape, 8), np.float32)

        def fill(index: int) -> None:
            image = self.images[index]
            out[index, ..., :4], out[index, ..., 4:7], out[index, ..., 7] = image.rgba, image.normal, image.depth

        map_in_threads(fill, range(len(self.images)))
        return out

    def check_scorable(self, indices: list[int]) -> None:
        """ValueError where ``indices`` names no view to score."""
        if not indices:
            raise ValueError(f"no held-out view to score (of {len(self.images)} views); render more views, or "
                             "hold out more of them")

    def score(self, picture: Callable[[int], np.ndarray], indices: list[int]) -> dict[str, float]:
        """Mean PSNR and SSIM of ``picture(index)`` (an RGB picture of view ``index``, from whatever renders it)
        against the views ``indices``; ValueError where there is none to score."""
        self.check_scorable(indices)
        psnrs, ssims = [], []
        for index in indices:
            image, reference = picture(index), self.images[index].rgb()
            psnrs.append(psnr(image, reference))
            ssims.append(ssim(image, reference))
        return {"heldout_psnr": float(np.mean(psnrs)), "heldout_ssim": float(np.mean(ssims))}


def render_reference_views(
    gpu: GpuContext,
    prepared: PreparedStudy,
    count: int,
    width: int,
    height: int,
    shadows: bool = False,
    view_angle: float = 30.0,
    held_out_every: int = 8,
    progress: Progress | None = None,
    cache_root: Path | None = None,
) -> ReferenceViews:
    """Orbit views of the prepared study; from the view cache when the same views were rendered before
    (``cache_root`` overrides its folder; a study without ``prepared.key`` is never cached)."""
    report = progress or (lambda message, fraction: None)
    style = RenderStyle.default(prepared.structures, prepared.channel_names)
    cameras = orbit_cameras(prepared.bounds, count, width, height, view_angle)
    training, held_out = split_views(count, held_out_every)
    path = None
    if prepared.key:
        key = view_cache_key(gpu, prepared, style, cameras, shadows)
        path = (cache_root or cache_folder("views")) / key
        images = _load_views(path, count, width, height)
        if images is not None:
            report("views loaded from cache", 1.0)
            return ReferenceViews(cameras, images, training, held_out)
    renderer = ReferenceRenderer(gpu, prepared, style)
    images = []
    for index, camera in enumerate(cameras):
        report(f"view {index + 1}/{count}", index / count)
        images.append(renderer.render(camera, shadows=shadows))
    report("views rendered", 1.0)
    if path is not None:
        _store_views(path, images)
    return ReferenceViews(cameras, images, training, held_out)


def view_cache_key(gpu: GpuContext, prepared: PreparedStudy, style: RenderStyle, cameras: list[Camera],
                   shadows: bool) -> str:
    """Digest of everything that decides the views' pixels."""
    digest = hashlib.sha256(f"views v{VIEW_CACHE_VERSION} {prepared.key} {gpu.backend} {shadows}".encode())
    digest.update(repr(prepared.structures).encode())
    digest.update(repr(style).encode())
    digest.update(repr(cameras).encode())
    digest.update(shader_sources_digest().encode())
    return digest.hexdigest()[:32]


def _load_views(path: Path, count: int, width: int, height: int) -> list[RenderedImage] | None:
    """The cached views at ``path``, or None (absent, unreadable or of another size: render again)."""
    entry = read_entry(path)
    if entry is None:
        return None
    arrays = entry[0]
    if not {"rgba", "depth", "normal"} <= set(arrays):
        return None
    rgba, depth, normal = arrays["rgba"], arrays["depth"], arrays["normal"]
    if rgba.shape != (count, height, width, 4) or depth.shape != (count, height, width) \
            or normal.shape != (count, height, width, 3):
        return None
    return [RenderedImage(rgba[i], depth[i], normal[i]) for i in range(count)]


def _store_views(path: Path, images: list[RenderedImage]) -> None:
    """Keep the views (atomically; the newest entries stay)."""
    write_entry(path, {"rgba": np.stack([i.rgba for i in images]), "depth": np.stack([i.depth for i in images]),
                       "normal": np.stack([i.normal for i in images])}, keep=VIEW_CACHE_ENTRIES)


#: What to do when a folder to write views into holds something else.
VIEWS_FOLDER_REFUSAL = "views are written into a new or empty folder, or over views written before"


def is_views_folder(folder: Path) -> bool:
    """A folder :func:`save_reference_views` wrote (one new views may replace whole)."""
    return (Path(folder) / "cameras.json").is_file()


def check_views_folder(folder: str | Path) -> None:
    """Refuse (FileExistsError) a folder :func:`save_reference_views` would not write: to ask before rendering."""
    check_replaceable(folder, is_views_folder, VIEWS_FOLDER_REFUSAL)


def save_reference_views(views: ReferenceViews, folder: str | Path, arrays: bool = True) -> Path:
    """Write ``views/NNN.png`` (RGBA), ``depth/``, ``normal/``, ``contact_sheet.png``, ``cameras.json``
    and, with ``arrays``, ``reference.npz`` (float arrays: rgba, depth, normal) into ``folder``, whole or not
    at all: views written there before are replaced only once every new file is written (none of theirs
    kept); a folder holding anything else is refused (FileExistsError). A run folder's views go without the
    arrays: compressing them takes seconds after training and they are the view cache's already."""
    folder = Path(folder)
    with atomic_folder(folder, is_views_folder, VIEWS_FOLDER_REFUSAL) as staging:
        _write_views(views, staging, arrays)
    return folder


def _write_views(views: ReferenceViews, folder: Path, arrays: bool) -> None:
    def write_view(index: int) -> None:
        image = views.images[index]
        rgba = image.rgba.copy()
        alpha = rgba[..., 3:4]
        rgba[..., :3] = np.where(alpha > 0, rgba[..., :3] / np.maximum(alpha, 1e-8), 0.0)  # straight alpha
        save_png(rgba, folder / "views" / f"{index:03d}.png", FAST_PNG)
        save_png(depth_picture(image.depth), folder / "depth" / f"{index:03d}.png", FAST_PNG)
        save_png(normal_picture(image.normal), folder / "normal" / f"{index:03d}.png", FAST_PNG)

    def write_sheet() -> None:  # tiled as bytes: the 24 views of 512² as floats took longer than their encoding
        sheet = contact_sheet([to_uint8(image.rgb()) for image in views.images])
        save_png(sheet, folder / "contact_sheet.png", FAST_PNG)

    # In threads, the contact sheet (the largest picture) first: PNG's compression releases the GIL, and one
    # thread took longer to write a run's views than the standard preset takes to train.
    tasks = [write_sheet, *(functools.partial(write_view, index) for index in range(len(views.images)))]
    map_in_threads(lambda task: task(), tasks)
    cameras = [{"index": i, "split": "held_out" if i in views.held_out else "training", **c.to_slicer()}
               for i, c in enumerate(views.cameras)]
    write_text(folder / "cameras.json", json.dumps({"cameras": cameras}, indent=2) + "\n")
    if not arrays:
        return
    with atomic_file(folder / "reference.npz") as handle:
        np.savez_compressed(
            handle,
            rgba=np.stack([i.rgba for i in views.images]),
            depth=np.stack([i.depth for i in views.images]),
            normal=np.stack([i.normal for i in views.images]),
        )
