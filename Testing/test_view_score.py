"""Held-out views scored on the device (render/view_score.py) give metrics.py's PSNR and SSIM."""

from __future__ import annotations

import numpy as np
import pytest

from NeuralRaycastLib.render.camera import Camera
from NeuralRaycastLib.render.image import PLANE_FLOATS, RenderedImage
from NeuralRaycastLib.render.metrics import psnr, ssim
from NeuralRaycastLib.render.reference_views import ReferenceViews
from NeuralRaycastLib.render.view_score import DeviceViewScorer


class PlanesOnDevice:
    """A renderer whose pictures are given: their G-buffer planes put on the device as the neural renderer
    leaves them (RGBA interleaved first)."""

    def __init__(self, gpu, pictures: dict[int, np.ndarray]) -> None:
        self.gpu, self.pictures = gpu, pictures
        self.cameras = {}

    def render_on_device(self, camera: Camera, rays_per_pass=None):
        import slangpy as spy

        rgba = self.pictures[self.cameras[id(camera)]]
        planes = np.zeros(rgba.shape[0] * rgba.shape[1] * PLANE_FLOATS, np.float32)
        planes[: rgba.size] = rgba.reshape(-1)
        return spy.Tensor.from_numpy(self.gpu.device, planes)


def picture(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Smooth shading with edges and noise, some of it outside [0, 1] (the clip is part of the metric), in
    premultiplied RGBA."""
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    rgb = np.stack([np.sin(7 * x + 3 * y), np.cos(5 * y) * x, (x > 0.5) * 0.8 + 0.1 * y], axis=-1)
    rgb = rgb + 0.15 * rng.standard_normal(rgb.shape)
    alpha = np.clip(1.3 - y, 0.0, 1.0)[..., None]
    return np.concatenate([rgb * alpha, alpha], axis=-1).astype(np.float32)


def test_device_scores_are_the_metrics_psnr_and_ssim(gpu):
    rng = np.random.default_rng(3)
    height, width = 37, 52  # not square: rows and columns must not be mixed up
    references = [picture(rng, height, width) for _ in range(2)]
    rendered = {i: np.clip(r + 0.05 * rng.standard_normal(r.shape).astype(np.float32), -0.2, 1.2)
                for i, r in enumerate(references)}
    cameras = [Camera((0.0, 0.0, 100.0 + i), (0.0, 0.0, 0.0), (0.0, 1.0, 0.0), 30.0, width, height) for i in range(2)]
    images = [RenderedImage(r, np.zeros((height, width), np.float32), np.zeros((height, width, 3), np.float32))
              for r in references]
    views = ReferenceViews(cameras, images, training=[], held_out=[0, 1])
    renderer = PlanesOnDevice(gpu, rendered)
    renderer.cameras = {id(c): i for i, c in enumerate(cameras)}
    scorer = DeviceViewScorer(gpu)

    for index in (0, 1):
        got_psnr, got_ssim = scorer.score_view(renderer, views, index)
        shown = RenderedImage(rendered[index], images[index].depth, images[index].normal).rgb()
        assert got_psnr == pytest.approx(psnr(shown, images[index].rgb()), abs=1e-4)
        assert got_ssim == pytest.approx(ssim(shown, images[index].rgb()), abs=1e-5)
    both = scorer.score(renderer, views, [0, 1])
    host = views.score(lambda i: RenderedImage(rendered[i], images[i].depth, images[i].normal).rgb(), [0, 1])
    assert both["heldout_psnr"] == pytest.approx(host["heldout_psnr"], abs=1e-4)
    assert both["heldout_ssim"] == pytest.approx(host["heldout_ssim"], abs=1e-5)


def test_device_scores_refuse_no_view_and_a_picture_smaller_than_the_window(gpu):
    scorer = DeviceViewScorer(gpu)
    small = Camera((0.0, 0.0, 100.0), (0.0, 0.0, 0.0), (0.0, 1.0, 0.0), 30.0, 10, 40)
    image = RenderedImage(np.zeros((40, 10, 4), np.float32), np.zeros((40, 10), np.float32),
                          np.zeros((40, 10, 3), np.float32))
    views = ReferenceViews([small], [image], training=[0], held_out=[])
    with pytest.raises(ValueError, match="no held-out view to score"):
        scorer.score(PlanesOnDevice(gpu, {}), views, [])
    with pytest.raises(ValueError, match="at least 11 pixels"):
        scorer.score_view(PlanesOnDevice(gpu, {}), views, 0)
