"""Held-out views scored on the device (shaders/view_score.slang): training evaluates its held-out views
every few dozen steps, and scoring a 512² picture on the host (read back, convert, SSIM's Gaussian filters
in float64) took far longer than rendering it. Here the rendered G-buffer stays where it was made and only
two numbers per picture row come back. The definitions are :mod:`.metrics`' (PSNR, SSIM), which remain the
reference the tests compare with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..gpu.device import device_memory
from .image_loss import SSIM_PAD, gaussian_window
from .metrics import SSIM_K1, SSIM_K2

if TYPE_CHECKING:
    from ..gpu.device import GpuContext
    from .neural_render import DiffRenderer
    from .reference_views import ReferenceViews


class DeviceViewScorer:
    """PSNR and SSIM of a renderer's views against reference views, as :meth:`ReferenceViews.score` gives them
    (float32 on the device, summed in float64 per row and on the host). The reference pictures go up once
    per view and stay, for the evaluations that follow."""

    def __init__(self, gpu: GpuContext) -> None:
        import slangpy as spy

        self.gpu = gpu
        self.module = gpu.load_module("view_score")
        self._window = spy.Tensor.from_numpy(gpu.device, np.ascontiguousarray(gaussian_window(), np.float32))
        self._references: dict[int, object] = {}
        self._pixel_sums = self._row_sums = None

    def _buffers(self, width: int, height: int) -> None:
        import slangpy as spy

        if self._pixel_sums is None or self._pixel_sums.shape[0] != width * height * 2:
            self._pixel_sums = self._row_sums = None
            with device_memory(f"scoring a {width} × {height} view"):
                self._pixel_sums = spy.Tensor.zeros(self.gpu.device, shape=(width * height * 2,), dtype="float")
                self._row_sums = spy.Tensor.zeros(self.gpu.device, shape=(height * 2,), dtype="float")

    def _reference(self, views: ReferenceViews, index: int):
        import slangpy as spy

        if index not in self._references:
            rgb = np.ascontiguousarray(views.images[index].rgb(), np.float32).reshape(-1)
            with device_memory("a reference view"):
                self._references[index] = spy.Tensor.from_numpy(self.gpu.device, rgb)
        return self._references[index]

    def score_view(self, renderer: DiffRenderer, views: ReferenceViews, index: int,
                   rays_per_pass: int | None = None) -> tuple[float, float]:
        """PSNR (dB) and SSIM of the renderer's picture of view ``index``."""
        import slangpy as spy

        camera = views.cameras[index]
        width, height = camera.width, camera.height
        if min(width, height) <= 2 * SSIM_PAD:
            raise ValueError(f"images must be at least {2 * SSIM_PAD + 1} pixels on each side for SSIM")
        self._buffers(width, height)
        planes = renderer.render_on_device(camera, rays_per_pass)
        buffers = {
            "planes": planes.storage.device_address,
            "reference": self._reference(views, index).storage.device_address,
            "window": self._window.storage.device_address,
            "pixelSums": self._pixel_sums.storage.device_address,
            "rowSums": self._row_sums.storage.device_address,
            "width": width, "height": height, "radius": SSIM_PAD,
            "c1": SSIM_K1**2, "c2": SSIM_K2**2,  # data range 1
        }
        self.module.viewScorePixel(spy.grid((width * height,)), buffers)
        self.module.viewScoreRows(spy.grid((height,)), buffers)
        squared, ssim = np.asarray(self._row_sums.to_numpy(), np.float64).reshape(height, 2).sum(axis=0)
        mse = squared / (width * height * 3)
        inner = (width - 2 * SSIM_PAD) * (height - 2 * SSIM_PAD) * 3
        return (float("inf") if mse == 0.0 else float(-10.0 * np.log10(mse))), float(ssim / inner)

    def score(self, renderer: DiffRenderer, views: ReferenceViews, indices: list[int],
              rays_per_pass: int | None = None) -> dict[str, float]:
        """Mean PSNR and SSIM over the views ``indices`` (ValueError where there is none), the keys of
        :meth:`ReferenceViews.score`."""
        views.check_scorable(indices)
        scores = [self.score_view(renderer, views, index, rays_per_pass) for index in indices]
        return {"heldout_psnr": float(np.mean([s[0] for s in scores])),
                "heldout_ssim": float(np.mean([s[1] for s in scores]))}
