"""The live neural view without Slicer's application: camera conversion, coalesced renders, and the picture over
a real (offscreen) VTK render window following a Slicer camera node moved by the mouse, by a script and by the
view's reset."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import sphere_actor

from NeuralRaycastLib.render.camera import Camera
from NeuralRaycastLib.render.live_view import (
    PARALLEL_REFUSAL,
    LiveRenderScheduler,
    LiveView,
    camera_from_vtk,
    live_camera,
    live_size,
    rgba_bytes,
    time_live_frames,
)


def test_a_slicer_camera_becomes_the_renderers_camera_at_the_views_size():
    camera = live_camera((10.0, -400.0, 20.0), (10.0, 0.0, 20.0), (0.0, 0.0, 1.0), 30.0, (640, 480))
    assert (camera.width, camera.height, camera.view_angle) == (640, 480, 30.0)
    right, up, forward = camera.basis()
    np.testing.assert_allclose(forward, (0, 1, 0))  # looking anterior from posterior
    np.testing.assert_allclose(up, (0, 0, 1))
    np.testing.assert_allclose(right, (1, 0, 0))  # seen from behind, the patient's right is the screen's right
    values = camera.to_slicer()
    again = live_camera(values["position"], values["focal_point"], values["view_up"], values["view_angle"],
                        values["size"])
    assert again == camera


def test_a_horizontal_view_angle_is_made_vertical_and_a_parallel_view_is_refused():
    camera = live_camera((0, -100, 0), (0, 0, 0), (0, 0, 1), 60.0, (400, 200), horizontal_angle=True)
    expected = math.degrees(2 * math.atan(math.tan(math.radians(30.0)) * 200 / 400))
    assert camera.view_angle == pytest.approx(expected)
    with pytest.raises(ValueError, match="orthographic"):
        live_camera((0, -100, 0), (0, 0, 0), (0, 0, 1), 30.0, (400, 200), parallel=True)


def test_the_picture_size_follows_the_view_within_the_renderers_limits():
    assert live_size(1024, 768) == (1024, 768)
    assert live_size(1024, 768, scale=0.5) == (512, 384)
    assert live_size(5000, 2500) == (4096, 2048)  # the renderer's largest side, aspect kept
    assert live_size(300, 8) == (600, 16)  # a collapsed view: the narrow side at the smallest
    with pytest.raises(ValueError, match="no area"):
        live_size(0, 100)
    with pytest.raises(ValueError, match="scale"):
        live_size(100, 100, scale=0.0)


def test_renders_are_coalesced_the_latest_camera_wins_and_nothing_queues_up():
    queue, rendered, shown = [], [], []
    cameras = [live_camera((0, -100 - i, 0), (0, 0, 0), (0, 0, 1), 30.0, (32, 32)) for i in range(50)]

    def render(camera):
        rendered.append(camera)
        if len(rendered) == 1:  # camera events arriving while a render runs (even from inside it) wait
            for later in cameras[10:20]:
                scheduler.request(later)
            assert scheduler.rendering and scheduler.waiting is cameras[19] and queue == []
        return camera.position

    scheduler = LiveRenderScheduler(render, lambda camera, picture: shown.append(picture), queue.append)
    for camera in cameras[:10]:  # a mouse drag: many camera events before the next turn of the event loop
        scheduler.request(camera)
    assert len(queue) == 1 and rendered == []  # one deferred call, however many events
    while queue:
        queue.pop(0)()
    assert rendered == [cameras[9], cameras[19]]  # only the latest of each burst
    assert shown == [cameras[9].position, cameras[19].position]
    assert scheduler.stats.most_waiting == 1 and scheduler.stats.superseded == 18
    assert scheduler.waiting is None and not scheduler.rendering


def test_a_failed_render_is_reported_once_and_the_waiting_camera_dropped():
    queue, errors = [], []

    def render(camera):
        scheduler.request(camera)  # one more waiting when the failure comes
        raise RuntimeError("device lost")

    scheduler = LiveRenderScheduler(render, lambda camera, picture: None, queue.append, errors.append)
    scheduler.request(live_camera((0, -100, 0), (0, 0, 0), (0, 0, 1), 30.0, (32, 32)))
    while queue:
        queue.pop(0)()
    assert [str(error) for error in errors] == ["device lost"]
    assert scheduler.waiting is None and queue == []


def test_premultiplied_pictures_become_straight_alpha_bytes_bottom_row_first():
    rgba = np.zeros((2, 3, 4), np.float32)
    rgba[0, 0] = (0.25, 0.0, 0.0, 0.5)  # top-left: half-covered red, premultiplied
    pixels = rgba_bytes(rgba)
    assert pixels.shape == (2, 3, 4) and pixels.dtype == np.uint8
    np.testing.assert_array_equal(pixels[1, 0], (128, 0, 0, 128))  # VTK's rows start at the bottom
    np.testing.assert_array_equal(pixels[0], 0)


# --- the live view on a render window and a Slicer camera node ----------------------------------------------


def field_picture(camera: Camera) -> np.ndarray:
    """Stands in for the trained field's render: opaque, its colour coding the camera's direction."""
    forward = camera.basis()[2]
    rgba = np.ones((camera.height, camera.width, 4), np.float32)
    rgba[..., :3] = (forward + 1.0) / 2.0
    return rgba


@pytest.fixture
def view():
    """An offscreen 3D view: a render window of 64 x 48 pixels whose renderer shows a Slicer camera node's
    camera, with VTK's trackball interactor (mouse drags rotate that camera)."""
    slicer = pytest.importorskip("slicer")
    import vtk

    window = vtk.vtkRenderWindow()
    window.SetOffScreenRendering(1)
    window.SetSize(64, 48)
    renderer = vtk.vtkRenderer()
    window.AddRenderer(renderer)
    renderer.AddActor(sphere_actor(60.0))
    camera_node = slicer.vtkMRMLCameraNode()
    renderer.SetActiveCamera(camera_node.GetCamera())
    interactor = vtk.vtkRenderWindowInteractor()
    interactor.SetRenderWindow(window)
    interactor.SetInteractorStyle(vtk.vtkInteractorStyleTrackballCamera())
    window.Render()
    return window, renderer, camera_node, interactor


def drag(interactor, start, end) -> None:
    import vtk

    interactor.SetEventInformation(*start)
    interactor.InvokeEvent(vtk.vtkCommand.LeftButtonPressEvent)
    interactor.SetEventInformation(*end)
    interactor.InvokeEvent(vtk.vtkCommand.MouseMoveEvent)
    interactor.InvokeEvent(vtk.vtkCommand.LeftButtonReleaseEvent)


def test_the_live_view_follows_the_mouse_scripts_and_the_reset_at_the_views_size(view):
    window, renderer, camera_node, interactor = view
    queue, renders = [], []

    def render(camera):
        renders.append(camera)
        return field_picture(camera)

    live = LiveView(camera_node, window, render, queue.append, redraw=window.Render)

    def settle():
        assert len(queue) <= 1, "renders queued up"
        while queue:
            queue.pop(0)()

    def expected():
        return camera_from_vtk(camera_node.GetCamera(), (64, 48))

    settle()
    assert renders == [expected()] and live.shown == [(64, 48)]

    # by the mouse: a drag through the view's own interactor (the picture's layer takes no input)
    before = camera_node.GetPosition()
    drag(interactor, (30, 24), (40, 30))
    assert camera_node.GetPosition() != before
    settle()
    assert renders[-1] == expected() and len(renders) == 2

    # by a script: several changes coalesce into one render of the final camera
    camera_node.SetPosition(0.0, -500.0, 0.0)
    camera_node.SetFocalPoint(0.0, 0.0, 10.0)
    camera_node.SetViewUp(0.0, 0.0, 1.0)
    settle()
    assert renders[-1] == expected() and len(renders) == 3
    assert renders[-1].position == (0.0, -500.0, 0.0)

    # by the view's reset (what the 3D view's "reset field of view" does to its camera node)
    camera_node.Reset(True, True, True, renderer)
    settle()
    assert renders[-1] == expected() and len(renders) == 4

    # what leaves the picture as it is (a redraw resetting the clipping range) renders nothing
    camera_node.GetCamera().SetClippingRange(1.0, 5000.0)
    camera_node.GetCamera().Modified()
    renderer.ResetCameraClippingRange()
    window.Render()
    assert queue == [] and len(renders) == 4

    # a resized view renders at its new size
    window.SetSize(80, 40)
    settle()
    assert (renders[-1].width, renders[-1].height) == (80, 40) and live.shown[-1] == (80, 40)

    # the picture is what the window shows, over the whole view
    window.Render()
    np.testing.assert_array_equal(window_pixels(window)[20, 40], rgba_bytes(field_picture(renders[-1]))[20, 40, :3])

    live.close()
    camera_node.SetPosition(0.0, -600.0, 0.0)
    settle()
    assert len(renders) == 5 and not window.HasRenderer(live.layer.renderer)


def window_pixels(window) -> np.ndarray:
    """What an offscreen window shows, (H, W, 3) bytes, row 0 at the bottom."""
    import vtk
    from vtk.util.numpy_support import vtk_to_numpy

    grab = vtk.vtkWindowToImageFilter()
    grab.SetInput(window)
    grab.ReadFrontBufferOff()
    grab.Update()
    width, height, _ = grab.GetOutput().GetDimensions()
    return vtk_to_numpy(grab.GetOutput().GetPointData().GetScalars()).reshape(height, width, -1)[..., :3]


def test_a_parallel_projection_is_said_and_not_rendered(view):
    window, _renderer, camera_node, _interactor = view
    queue, errors = [], []
    camera_node.SetParallelProjection(True)
    live = LiveView(camera_node, window, field_picture, queue.append, on_error=errors.append)
    assert queue == [] and [str(error) for error in errors] == [PARALLEL_REFUSAL]
    live.close()


def test_the_frame_rate_command_times_renders_through_the_scheduler():
    calls = []
    result = time_live_frames(lambda camera: calls.append(camera), (0, 0, 0), 300.0, 12, 32, 24)
    assert len(calls) == 13  # the first frame timed apart, then one render per camera: none dropped or doubled
    assert len({camera.position for camera in calls[1:]}) == 12
    assert all((camera.width, camera.height) == (32, 24) for camera in calls)
    assert result["frames"] == 12 and result["frames_per_second"] > 0


@pytest.mark.parametrize(("extra", "message"), [
    (["--frames", "0"], "frames must be at least 1 (got 0)"),
    (["--size", "8000", "600"], "view size 8000 x 600 pixels is outside the supported range"),
])
def test_the_frame_rate_command_refuses_bad_values_in_one_line_before_opening_the_run(extra, message, tmp_path,
                                                                                      capsys):
    from NeuralRaycastLib.app.cli import main

    assert main(["frame-rate", str(tmp_path / "no-run"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"neuralraycast frame-rate: error: {message}") and "\n" not in err


def test_the_frame_rate_command_has_help(capsys):
    from NeuralRaycastLib.app.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["frame-rate", "--help"])
    assert exit_info.value.code == 0
    assert "usage: neuralraycast frame-rate" in capsys.readouterr().out
