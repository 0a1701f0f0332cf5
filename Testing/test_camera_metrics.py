"""Cameras (Slicer round trip, orbits, splits) and image metrics (SSIM as scikit-image computes it)."""

from __future__ import annotations

import numpy as np
import pytest
from skimage.metrics import structural_similarity

from NeuralRaycastLib.render.camera import Camera, orbit_cameras, split_views
from NeuralRaycastLib.render.metrics import contact_sheet, dssim, l1, psnr, ssim


def test_slicer_camera_round_trip():
    camera = Camera((10.0, -300.0, 40.0), (5.0, 2.0, -3.0), (0.1, 0.2, 1.0), 27.5, 320, 200)
    values = camera.to_slicer()
    again = Camera.from_slicer(values["position"], values["focal_point"], values["view_up"],
                               values["view_angle"], values["size"])
    for a, b in zip(camera.basis(), again.basis(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-12)
    np.testing.assert_allclose(camera.ray_directions(), again.ray_directions(), atol=1e-12)
    for key, value in again.to_slicer().items():
        np.testing.assert_allclose(value, values[key], atol=1e-12)
    assert abs(np.dot(values["view_up"], np.subtract(values["focal_point"], values["position"]))) < 1e-9


def test_centre_pixel_looks_at_the_focal_point_and_row_zero_is_up():
    camera = Camera((0.0, -200.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 5, 3)
    directions = camera.ray_directions()
    np.testing.assert_allclose(directions[1, 2], [0.0, 1.0, 0.0], atol=1e-12)
    assert directions[0, 2, 2] > 0 > directions[2, 2, 2]  # top row looks up (Superior)
    assert directions[1, 4, 0] > 0  # right column looks to the patient's Right (+x) from the front


def test_bad_cameras_are_refused():
    with pytest.raises(ValueError, match="view angle"):
        Camera((0, 0, 1), (0, 0, 0), (0, 1, 0), 0.0, 4, 4)
    with pytest.raises(ValueError, match="parallel"):
        Camera((0, 0, 1), (0, 0, 0), (0, 0, 1), 30.0, 4, 4)
    with pytest.raises(ValueError, match="image size"):
        Camera((0, 0, 1), (0, 0, 0), (0, 1, 0), 30.0, 0, 4)


def test_orbit_frames_the_box_from_spread_out_directions():
    bounds = np.array([[-70.0, -100.0, -60.0], [70.0, 80.0, 80.0]])
    cameras = orbit_cameras(bounds, 24, 64, 48, elevation_range=(-30, 60))
    centre = bounds.mean(axis=0)
    radius = (bounds[1] - bounds[0]).max() / 2
    directions = []
    for camera in cameras:
        np.testing.assert_allclose(camera.focal_point, centre)
        offset = np.subtract(camera.position, centre)
        distance = np.linalg.norm(offset)
        # a sphere of the box's largest half-side fits inside the vertical field of view
        assert np.degrees(np.arcsin(radius / distance)) < camera.view_angle / 2
        elevation = np.degrees(np.arcsin(offset[2] / distance))
        assert -30.0 <= elevation <= 60.0
        directions.append(offset / distance)
    directions = np.array(directions)
    nearest = np.sort(directions @ directions.T, axis=1)[:, -2]  # cosine to the closest other view
    assert np.degrees(np.arccos(nearest.max())) > 10.0  # no two views nearly the same
    assert orbit_cameras(bounds, 24, 64, 48, elevation_range=(-30, 60)) == cameras  # deterministic


def test_split_is_deterministic_and_disjoint():
    training, held_out = split_views(40, held_out_every=8)
    assert held_out == [3, 11, 19, 27, 35]
    assert sorted(training + held_out) == list(range(40))
    assert split_views(40, 8) == (training, held_out)


@pytest.mark.parametrize("shape", [(48, 64), (40, 52, 3), (33, 33, 4)])
def test_ssim_agrees_with_scikit_image(shape):
    rng = np.random.default_rng(sum(shape))
    a = rng.random(shape)
    b = np.clip(a + rng.normal(0.0, 0.15, shape), 0.0, 1.0)
    expected = structural_similarity(
        a, b, gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=1.0,
        channel_axis=-1 if len(shape) == 3 else None,
    )
    assert ssim(a, b) == pytest.approx(expected, abs=1e-9)  # they agree to rounding: 1e-3 let sigma 1.4 pass
    assert dssim(a, b) == pytest.approx((1 - expected) / 2, abs=1e-9)


def test_psnr_l1_and_identity():
    a = np.full((16, 16, 3), 0.5)
    b = a + 0.1
    assert psnr(a, b) == pytest.approx(20.0)
    assert l1(a, b) == pytest.approx(0.1)
    assert psnr(a, a) == float("inf") and ssim(a, a) == pytest.approx(1.0) and dssim(a, a) == pytest.approx(0.0)


def test_contact_sheet_places_images_in_rows():
    images = [np.full((4, 5, 3), i / 10) for i in range(5)]
    sheet = contact_sheet(images, columns=3, gap=1)
    assert sheet.shape == (9, 17, 3)
    assert sheet[5, 0, 0] == pytest.approx(0.3) and sheet[0, 12, 0] == pytest.approx(0.2)


def test_pictures_of_bytes_are_tiled_and_saved_as_they_are_at_either_compression(tmp_path):
    """A run's contact sheet is tiled from byte pictures and written at zlib's fastest level: the same pixels as
    the float pictures give at the default level, byte for byte."""
    from PIL import Image

    from NeuralRaycastLib.render.metrics import FAST_PNG, save_png, to_uint8

    rng = np.random.default_rng(1)
    images = [rng.random((6, 7, 3)) for _ in range(5)]
    tiled = contact_sheet([to_uint8(image) for image in images], columns=3, gap=1)
    assert tiled.dtype == np.uint8 and tiled.shape == (13, 23, 3) and tiled[7:, 16:].max() == 0  # the gap is black
    save_png(tiled, tmp_path / "fast.png", FAST_PNG)
    save_png(contact_sheet(images, columns=3, gap=1), tmp_path / "default.png")
    fast, default = (np.asarray(Image.open(tmp_path / name)) for name in ("fast.png", "default.png"))
    assert np.array_equal(fast, default) and np.array_equal(fast, tiled)
