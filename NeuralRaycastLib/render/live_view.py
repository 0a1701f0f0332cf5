"""The live neural view: the trained field rendered from a 3D view's camera whenever that camera moves.

Three parts, none of them tied to Slicer's application (the module wires them to its 3D view):

- :func:`live_camera`: a VTK / Slicer camera (position, focal point, view-up, view angle in RAS) and the
  view's size in pixels as the renderer's :class:`~NeuralRaycastLib.render.camera.Camera`;
- :class:`LiveRenderScheduler`: renders coalesced so they never queue up: at most one in flight and one
  waiting, the latest camera replacing the one that waited;
- :class:`ImageLayer` and :class:`LiveView`: the picture shown over a VTK render window, in a renderer
  layer of its own that takes no mouse input, re-rendered on every change of the camera (mouse, scripts,
  the view's reset: all of them modify the camera node) and of the window's size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from .camera import MAX_VIEW_SIZE, MIN_VIEW_SIZE, Camera, framing_distance

T = TypeVar("T")

#: Why a view cannot be shown live: the renderer is a pinhole camera.
PARALLEL_REFUSAL = "the live view needs a perspective 3D view: switch the view's orthographic projection off"


def live_size(width: int, height: int, scale: float = 1.0, max_side: int = MAX_VIEW_SIZE) -> tuple[int, int]:
    """The picture size for a view of ``width`` x ``height`` pixels: scaled by ``scale`` (a coarser picture
    renders faster), its longer side at most ``max_side``, each side at least the renderer's smallest, the
    view's aspect kept to a pixel (the picture is stretched over the whole view)."""
    if width < 1 or height < 1:
        raise ValueError(f"the view has no area ({width} x {height} pixels)")
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"the live view's scale must lie in (0, 1], got {scale}")
    factor = scale * min(1.0, max_side / max(width, height))
    w, h = max(1, round(width * factor)), max(1, round(height * factor))
    if min(w, h) < MIN_VIEW_SIZE:  # a thin view: its narrow side at the smallest, the long one in proportion
        grow = MIN_VIEW_SIZE / min(w, h)
        w, h = min(MAX_VIEW_SIZE, round(w * grow)), min(MAX_VIEW_SIZE, round(h * grow))
    return int(w), int(h)


def live_camera(position, focal_point, view_up, view_angle: float, view_size: tuple[int, int], scale: float = 1.0,
                max_side: int = MAX_VIEW_SIZE, horizontal_angle: bool = False, parallel: bool = False) -> Camera:
    """The renderer's camera for a VTK camera's values (RAS) and the view's size in pixels (width, height).

    VTK's view angle is vertical unless ``horizontal_angle`` (vtkCamera's UseHorizontalViewAngle); the
    renderer's is always vertical. A parallel projection is refused (ValueError)."""
    if parallel:
        raise ValueError(PARALLEL_REFUSAL)
    width, height = live_size(int(view_size[0]), int(view_size[1]), scale, max_side)
    angle = float(view_angle)
    if horizontal_angle:
        angle = math.degrees(2.0 * math.atan(math.tan(math.radians(angle) / 2.0) * height / width))
    return Camera.from_slicer(position, focal_point, view_up, angle, (width, height))


def camera_from_vtk(camera, view_size: tuple[int, int], scale: float = 1.0, max_side: int = MAX_VIEW_SIZE) -> Camera:
    """:func:`live_camera` of a ``vtkCamera`` (what a Slicer camera node holds: ``cameraNode.GetCamera()``)."""
    return live_camera(camera.GetPosition(), camera.GetFocalPoint(), camera.GetViewUp(), camera.GetViewAngle(),
                       view_size, scale, max_side, bool(camera.GetUseHorizontalViewAngle()),
                       bool(camera.GetParallelProjection()))


@dataclass
class LiveStats:
    """What a scheduler did: cameras asked for, pictures rendered, cameras replaced by a later one before
    their turn, the most cameras ever waiting at once (never above one) and the seconds spent rendering."""

    requested: int = 0
    rendered: int = 0
    superseded: int = 0
    most_waiting: int = 0
    render_seconds: float = 0.0


class LiveRenderScheduler(Generic[T]):
    """Coalesced renders: ``request`` keeps only the latest camera; ``defer`` runs the render later (Slicer: a
    zero-delay Qt timer, so the mouse events that arrived meanwhile are all handled first and only the last
    camera is rendered). At most one render is in flight and one camera waits; a request made while a render
    runs (even from inside it) waits for it and then starts the next.

    :param render: camera -> picture (blocking).
    :param show: ``show(camera, picture)`` once a render is complete.
    :param defer: ``defer(callback)`` runs ``callback`` soon, after pending events.
    :param on_error: called with a render's exception (the waiting camera is dropped); without it, it raises.
    """

    def __init__(self, render: Callable[[Camera], T], show: Callable[[Camera, T], None],
                 defer: Callable[[Callable[[], None]], None],
                 on_error: Callable[[Exception], None] | None = None) -> None:
        self._render, self._show, self._defer, self._on_error = render, show, defer, on_error
        self._waiting: Camera | None = None
        self._scheduled = False
        self._rendering = False
        self._stopped = False
        self.stats = LiveStats()

    @property
    def waiting(self) -> Camera | None:
        """The camera that renders next, if any."""
        return self._waiting

    @property
    def rendering(self) -> bool:
        return self._rendering

    def request(self, camera: Camera) -> None:
        """Render ``camera`` soon, replacing any camera that has not started rendering yet."""
        if self._stopped:
            return
        self.stats.requested += 1
        if self._waiting is not None:
            self.stats.superseded += 1
        self._waiting = camera
        self.stats.most_waiting = max(self.stats.most_waiting, 1)
        self._schedule()

    def stop(self) -> None:
        """Drop the waiting camera and ignore later requests (a render in flight still completes)."""
        self._stopped = True
        self._waiting = None

    def _schedule(self) -> None:
        if not self._scheduled and not self._rendering:
            self._scheduled = True
            self._defer(self._run)

    def _run(self) -> None:
        self._scheduled = False
        if self._rendering or self._waiting is None or self._stopped:
            return
        camera, self._waiting = self._waiting, None
        self._rendering = True
        start = time.perf_counter()
        try:
            picture = self._render(camera)
            self.stats.rendered += 1
            self.stats.render_seconds += time.perf_counter() - start
            if not self._stopped:
                self._show(camera, picture)
        except Exception as error:
            self._waiting = None
            if self._on_error is None:
                raise
            self._on_error(error)
            return
        finally:
            self._rendering = False
        if self._waiting is not None:
            self._schedule()


def rgba_bytes(rgba: np.ndarray) -> np.ndarray:
    """A premultiplied float RGBA picture (H, W, 4) in [0, 1] as straight-alpha bytes, the rows bottom first
    (VTK images start at the bottom; the renderer's row 0 is the top)."""
    rgba = np.asarray(rgba, np.float32)
    if rgba.ndim != 3 or rgba.shape[2] != 4:
        raise ValueError(f"expected an (H, W, 4) picture, got shape {rgba.shape}")
    # A few passes over float32 in place: a frame's conversion must not cost more than its render.
    height, width = rgba.shape[:2]
    alpha = rgba[..., 3]
    scale = np.zeros((height, width), np.float32)
    np.divide(255.0, alpha, out=scale, where=alpha > 1e-6)
    pixels = np.empty((height, width, 4), np.uint8)
    rgb = rgba[..., :3] * scale[..., None]
    pixels[..., :3] = np.rint(np.clip(rgb, 0.0, 255.0, out=rgb), out=rgb)
    opacity = alpha * 255.0
    pixels[..., 3] = np.rint(np.clip(opacity, 0.0, 255.0, out=opacity), out=opacity)
    return np.ascontiguousarray(pixels[::-1])


class ImageLayer:
    """An RGBA picture stretched over a whole VTK render window, above what the window shows, in a renderer
    layer of its own that takes no interaction (the mouse still moves the view's own camera). Where the
    picture is transparent (nothing hit) the view beneath shows through."""

    def __init__(self, render_window) -> None:
        import vtk

        self.render_window = render_window
        self.image = vtk.vtkImageData()
        self.actor = vtk.vtkImageActor()
        self.actor.GetMapper().SetInputData(self.image)
        self.actor.InterpolateOn()
        self.renderer = vtk.vtkRenderer()
        self.renderer.InteractiveOff()
        self.renderer.SetPreserveDepthBuffer(False)
        self.renderer.AddActor(self.actor)
        self.renderer.GetActiveCamera().ParallelProjectionOn()
        self.layer = render_window.GetNumberOfLayers()
        render_window.SetNumberOfLayers(self.layer + 1)
        self.renderer.SetLayer(self.layer)
        render_window.AddRenderer(self.renderer)

    def show(self, rgba: np.ndarray) -> None:
        """Show a picture: premultiplied float RGBA (H, W, 4), row 0 at the top, or the bytes
        :func:`rgba_bytes` (and the renderer's ``render_picture``) make of one."""
        from vtk.util.numpy_support import numpy_to_vtk

        pixels = rgba if rgba.dtype == np.uint8 else rgba_bytes(rgba)
        height, width = pixels.shape[:2]
        self.image.SetDimensions(width, height, 1)
        self.image.SetSpacing(1.0, 1.0, 1.0)
        self.image.SetOrigin(0.0, 0.0, 0.0)
        scalars = numpy_to_vtk(pixels.reshape(-1, 4), deep=True)
        scalars.SetName("RGBA")
        self.image.GetPointData().SetScalars(scalars)
        self.image.Modified()
        camera = self.renderer.GetActiveCamera()
        centre = ((width - 1) / 2.0, (height - 1) / 2.0)
        camera.SetFocalPoint(centre[0], centre[1], 0.0)
        camera.SetPosition(centre[0], centre[1], 1.0)
        camera.SetViewUp(0.0, 1.0, 0.0)
        camera.SetParallelScale(height / 2.0)
        self.renderer.ResetCameraClippingRange()
        self.actor.VisibilityOn()

    def size(self) -> tuple[int, int]:
        """The picture shown (width, height); (0, 0) before the first."""
        width, height, _depth = self.image.GetDimensions()
        return (width, height) if self.image.GetPointData().GetScalars() is not None else (0, 0)

    def pixels(self) -> np.ndarray:
        """The picture shown as (H, W, 4) bytes, row 0 at the top (what :meth:`show` was given)."""
        from vtk.util.numpy_support import vtk_to_numpy

        width, height = self.size()
        flat = vtk_to_numpy(self.image.GetPointData().GetScalars())
        return flat.reshape(height, width, 4)[::-1]

    def remove(self) -> None:
        """Take the layer off the window (the window keeps its number of layers: another may use them)."""
        self.render_window.RemoveRenderer(self.renderer)


class LiveView:
    """The trained field rendered over a 3D view whenever its camera or its size changes.

    :param camera_node: what holds the view's camera: a Slicer ``vtkMRMLCameraNode`` (``GetCamera()``, and a
        ModifiedEvent for every change: mouse, scripts and the view's reset) or a bare ``vtkCamera``.
    :param render_window: the view's ``vtkRenderWindow`` (its size in pixels is the view's).
    :param render: camera -> premultiplied RGBA (H, W, 4) picture.
    :param defer: see :class:`LiveRenderScheduler`.
    :param redraw: asks the view to draw itself again (Slicer: ``threeDView.scheduleRender``).
    :param on_error: told of a render's exception; the live view stops then.
    """

    def __init__(self, camera_node, render_window, render: Callable[[Camera], np.ndarray],
                 defer: Callable[[Callable[[], None]], None], redraw: Callable[[], None] = lambda: None,
                 on_error: Callable[[Exception], None] | None = None, scale: float = 1.0,
                 max_side: int = MAX_VIEW_SIZE) -> None:
        import vtk

        live_size(1, 1, scale)  # refuse a bad scale before anything is observed
        self.camera_node, self.render_window = camera_node, render_window
        self.scale, self.max_side, self._redraw, self._on_error = scale, max_side, redraw, on_error
        self.layer = ImageLayer(render_window)
        self.scheduler: LiveRenderScheduler[np.ndarray] = LiveRenderScheduler(render, self._show, defer,
                                                                              self._failed)
        self.shown: list[tuple[int, int]] = []  # sizes of the pictures shown, in order
        self.error: Exception | None = None
        self._last: Camera | None = None  # the camera last asked for
        self._observers: list[tuple[Any, int]] = [
            (camera_node, camera_node.AddObserver(vtk.vtkCommand.ModifiedEvent, self._changed)),
            (render_window, render_window.AddObserver(vtk.vtkCommand.WindowResizeEvent, self._changed)),
        ]
        self.refresh()

    def view_size(self) -> tuple[int, int]:
        width, height = self.render_window.GetSize()
        return int(width), int(height)

    def camera(self) -> Camera:
        """The renderer's camera for the view as it is now."""
        vtk_camera = self.camera_node.GetCamera() if hasattr(self.camera_node, "GetCamera") else self.camera_node
        return camera_from_vtk(vtk_camera, self.view_size(), self.scale, self.max_side)

    def refresh(self) -> None:
        """Render the view as it is now (soon, coalesced with other changes), unless that camera at that size
        was the last asked for: a camera node is also modified by what leaves the picture as it is (the
        clipping range each redraw resets), and a redraw must not start another render."""
        try:
            camera = self.camera()
        except ValueError as error:  # a parallel projection or a degenerate camera: said, not shown
            self._failed(error)
            return
        if camera == self._last:
            return
        self._last = camera
        self.scheduler.request(camera)

    def close(self) -> None:
        """Stop rendering, stop observing and take the picture off the view."""
        self.scheduler.stop()
        for obj, tag in self._observers:
            obj.RemoveObserver(tag)
        self._observers = []
        self.layer.remove()
        self._redraw()

    def _changed(self, caller=None, event=None) -> None:
        if self._observers:
            self.refresh()

    def _show(self, camera: Camera, rgba: np.ndarray) -> None:
        self.layer.show(rgba)
        self.shown.append(self.layer.size())
        self._redraw()

    def _failed(self, error: Exception) -> None:
        self.error = error
        if self._on_error is not None:
            self._on_error(error)


def time_live_frames(render: Callable[[Camera], Any], centre, distance: float, frames: int, width: int,
                     height: int, view_angle: float = 30.0) -> dict[str, float]:
    """Render ``frames`` pictures of ``width`` x ``height`` from a camera orbiting ``centre`` at ``distance``
    (a full turn over the frames, the way a mouse drag moves it) through a scheduler, as the live view does:
    ``frames_per_second`` and ``ms_per_frame`` after a first frame (which may compile kernels) timed apart."""
    if frames < 1:
        raise ValueError(f"frames must be at least 1 (got {frames})")
    centre = np.asarray(centre, np.float64)

    def orbit(index: int) -> Camera:
        angle = 2.0 * math.pi * index / frames
        position = centre + distance * np.array([math.cos(angle), math.sin(angle), 0.25])
        return live_camera(position, centre, (0.0, 0.0, 1.0), view_angle, (width, height))

    queue: list[Callable[[], None]] = []
    scheduler: LiveRenderScheduler[Any] = LiveRenderScheduler(render, lambda camera, picture: None, queue.append)
    start = time.perf_counter()
    render(orbit(0))
    first = time.perf_counter() - start
    start = time.perf_counter()
    for index in range(frames):
        scheduler.request(orbit(index))
        while queue:
            queue.pop(0)()
    seconds = time.perf_counter() - start
    return {"frames": frames, "width": width, "height": height, "first_frame_s": first,
            "frames_per_second": frames / seconds, "ms_per_frame": 1e3 * seconds / frames}


def time_live_view(render: Callable[[Camera], Any], bounds, frames: int, width: int, height: int) \
        -> dict[str, float]:
    """``time_live_frames`` around a study's box ``bounds`` (2, 3), framed as the live view's reset frames it:
    what ``neuralraycast frame-rate`` and the branches bench time."""
    low, high = np.asarray(bounds, np.float64)
    distance = framing_distance(float((high - low).max() / 2), 30.0, width, height)
    return time_live_frames(render, (low + high) / 2, distance, frames, width, height)
