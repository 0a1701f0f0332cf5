"""A scene of anisotropic 3-D Gaussians on the device, ray traced by shaders/gaussians.slang.

The parameters travel as one flat float32 buffer grouped by kind (positions, log-scales, rotations, density
logits, colours: the layout in the shader's header), so that Adam gives each kind its own learning rate and
the host can prune and split Gaussians by slicing arrays. The uniform grid of the Gaussians' three-sigma
boxes is built on the device (:meth:`GaussianScene.build_grid`) whenever the Gaussians move.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..gpu.device import GpuContext, ReadBack, device_memory
from ..render.camera import Camera
from ..render.image import PLANE_FLOATS, RenderedImage, image_from_planes
from ..render.sample_buffers import RayTiles
from .look import LOOK_FLOATS, NO_HIGHLIGHTS, ChannelVolumes, Highlights, any_textured

#: Floats per Gaussian: position 3, log-scale 3, rotation 4, density logit 1, colour 6 × 3.
GAUSSIAN_FLOATS = 29
#: Floats per Gaussian of its frame, what the march reads of it (shaders/gaussian_scene.slang's gaussianFrames).
FRAME_FLOATS = 36
#: Where each kind starts, in units of the Gaussian count N (shaders/gaussians.slang).
KIND_STARTS = {"position": 0, "log_scale": 3, "rotation": 6, "density": 10, "colour": 11}
SCAN_BLOCK = 256  # shaders/gaussian_grid.slang
#: Colour coefficients per RGB channel: degree-1 spherical harmonics (4), the facing |d · a| and the side
#: sign(d · a) of the ray against the Gaussian's third axis a.
COLOUR_TERMS = 6


@dataclass
class GaussianSet:
    """Gaussians on the host: positions (N, 3) mm, log_scales (N, 3), rotations (N, 4) quaternions (w, x, y, z),
    density logits (N,), colours (N, 6, 3): per RGB channel, degree-1 spherical-harmonic coefficients (4), then
    those of the facing |d · a| and the side sign(d · a) of a ray d against the third axis a
    (shaders/gaussians.slang); and looks (N, LOOK_FLOATS): what each takes from its structure's look besides them,
    the channels' texture and the specular weight (gaussians/look.py; zeros, the default: neither), data that
    training does not change."""

    positions: np.ndarray
    log_scales: np.ndarray
    rotations: np.ndarray
    density: np.ndarray
    colours: np.ndarray
    looks: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.positions)
        if self.looks is None:
            self.looks = np.zeros((n, LOOK_FLOATS), np.float32)
        shapes = {"positions": (n, 3), "log_scales": (n, 3), "rotations": (n, 4), "density": (n,),
                  "colours": (n, COLOUR_TERMS, 3), "looks": (n, LOOK_FLOATS)}
        for name, shape in shapes.items():
            value = np.asarray(getattr(self, name), np.float32)
            if value.shape != shape:
                raise ValueError(f"Gaussian {name} of shape {value.shape}, expected {shape}")
            setattr(self, name, value)

    @property
    def count(self) -> int:
        return len(self.positions)

    def flat(self) -> np.ndarray:
        """The shader's layout (with four zeros after it, for Adam's vector loads)."""
        parts = [self.positions, self.log_scales, self.rotations, self.density, self.colours]
        return np.concatenate([p.reshape(-1) for p in parts] + [np.zeros(4, np.float32)])

    @classmethod
    def from_flat(cls, values: np.ndarray, count: int, looks: np.ndarray | None = None) -> GaussianSet:
        """The Gaussians of flat parameters (:meth:`flat`), with ``looks`` (None: zeros)."""
        n, v = count, np.asarray(values, np.float32)
        return cls(v[: 3 * n].reshape(n, 3), v[3 * n : 6 * n].reshape(n, 3), v[6 * n : 10 * n].reshape(n, 4),
                   v[10 * n : 11 * n].copy(), v[11 * n : 29 * n].reshape(n, COLOUR_TERMS, 3), looks)

    def subset(self, keep: np.ndarray) -> GaussianSet:
        return GaussianSet(self.positions[keep], self.log_scales[keep], self.rotations[keep], self.density[keep],
                           self.colours[keep], self.looks[keep])

    @staticmethod
    def concatenate(sets: list[GaussianSet]) -> GaussianSet:
        return GaussianSet(*(np.concatenate([getattr(s, name) for s in sets]) for name in
                             ("positions", "log_scales", "rotations", "density", "colours", "looks")))

    def rotation_matrices(self) -> np.ndarray:
        """(N, 3, 3) rotations of the normalised quaternions."""
        q = self.rotations / np.linalg.norm(self.rotations, axis=1, keepdims=True)
        w, x, y, z = q.T
        return np.stack([
            np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)], axis=1),
            np.stack([2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)], axis=1),
            np.stack([2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], axis=1),
        ], axis=1)

    def half_extents(self) -> np.ndarray:
        """(N, 3): half the sides of the boxes around the three-sigma ellipsoids."""
        rotation = self.rotation_matrices().astype(np.float64)
        variance = np.einsum("naj,nj->na", rotation**2, np.exp(2.0 * self.log_scales.astype(np.float64)))
        return 3.0 * np.sqrt(variance)


@dataclass(frozen=True)
class GridShape:
    """The uniform grid over the scene's box: low and high corners (mm) and cells per axis."""

    low: tuple[float, float, float]
    high: tuple[float, float, float]
    dims: tuple[int, int, int]

    @classmethod
    def for_box(cls, bounds: np.ndarray, cell_mm: float, max_cells: int = 1 << 21) -> GridShape:
        """Cells of about ``cell_mm`` over ``bounds`` (2, 3), coarser where that would pass ``max_cells``."""
        bounds = np.asarray(bounds, np.float64)
        extent = bounds[1] - bounds[0]
        if not (extent > 0).all() or not cell_mm > 0:
            raise ValueError(f"a Gaussian grid needs a box with volume and cells of positive size "
                             f"(box {bounds.tolist()}, cell {cell_mm} mm)")
        cell = float(cell_mm)
        while np.prod(np.maximum(np.ceil(extent / cell), 1)) > max_cells:
            cell *= 1.25
        dims = tuple(int(d) for d in np.maximum(np.ceil(extent / cell), 1))
        return cls(tuple(map(float, bounds[0])), tuple(map(float, bounds[1])), dims)

    @property
    def cells(self) -> int:
        return int(np.prod(self.dims))

    @property
    def cell_size(self) -> np.ndarray:
        return (np.asarray(self.high) - np.asarray(self.low)) / np.asarray(self.dims)


@dataclass(frozen=True)
class MarchSettings:
    """The ray integration: segment length (mm) and the transmittance below which a ray stops."""

    step_mm: float = 0.5
    min_transmittance: float = 1e-3

    def to_shader(self, normals: bool = False) -> dict[str, float]:
        """The shader's settings; ``normals``: sum the density's normals too (a picture's G-buffer, not training)."""
        return {"step": float(self.step_mm), "minTransmittance": float(self.min_transmittance),
                "normals": int(normals)}


#: Whether a training batch's backward pass takes its patches' rays in turn (GaussianScene.backward).
BACKWARD_GROUPS = os.environ.get("NEURALRAYCAST_GAUSSIAN_GROUPS", "1") != "0"

#: Floats per ray of the Gaussians' results (shaders/gaussian_march.slang): RGBA, Σ weight·normal, Σ weight·depth, as
#: the field's per-ray sums (render/sample_buffers.OUTPUTS), so that the device image loss takes them as they are.
OUTPUTS = 8


class GaussianBatch:
    """Device buffers of a training batch of patch rays: the rays, their sums (OUTPUTS floats a ray) and the loss's
    ∂/∂sums (``d_sums``, written by render/image_loss.DeviceImageLoss), made once for a batch size."""

    def __init__(self, gpu: GpuContext, count: int) -> None:
        import slangpy as spy

        self.count = count
        with device_memory(f"a batch of {count:,} rays"):
            self.rays = spy.Tensor.zeros(gpu.device, shape=(6 * count,), dtype=float)
            self.sums = spy.Tensor.zeros(gpu.device, shape=(OUTPUTS * count,), dtype=float)
            self.d_sums = spy.Tensor.zeros_like(self.sums)
        self.patches: Any = None  # the rows the rays were made from, kept while the rays are
        self.groups = 1  # the patches the rays make


def tiled(camera: Camera) -> Any:
    """The launch of a picture's kernels: a camera's pixels in tiles of 8 x 4, a wave a tile
    (shaders/gaussians.slang's tiledPixel)."""
    return RayTiles(camera.width, camera.height).launch()


class GaussianScene:
    """Gaussians on the device: parameters, gradients, the grid of their bounds, and the render kernels."""

    def __init__(self, gpu: GpuContext, gaussians: GaussianSet, grid: GridShape, density_scale: float = 1.0,
                 march: MarchSettings | None = None, geometry_thickness: float = 1.0,
                 channels: ChannelVolumes | None = None, highlights: Highlights = NO_HIGHLIGHTS) -> None:
        """``geometry_thickness``: the share of each Gaussian's thickness (its third axis's standard deviation)
        with which the structure weights read it (shaders/gaussian_occupancy.slang's geometryLocal; 1: as the pictures).
        ``channels``: the study's channels on the device, which texture the Gaussians' colours as their look
        records say (None: no texture, whatever the records); ``highlights``: the lights of their specular terms."""
        if not 0.0 < geometry_thickness <= 1.0:
            raise ValueError(f"a geometry thickness of {geometry_thickness} (a share of the Gaussians' thickness, "
                             "in (0, 1])")
        self.gpu, self.grid, self.density_scale = gpu, grid, float(density_scale)
        self.geometry_thickness = float(geometry_thickness)
        self.channels, self.highlights = channels, highlights
        self.march = march or MarchSettings()
        self.module = gpu.load_module("gaussians")
        self._cell_start = self._counts = self._block_sums = self._cell_list = None
        self._list_capacity = 0
        self._picture: Any = None  # a camera's packed picture (render_picture) and G-buffer (render_image)
        self._planes: Any = None
        self._read_back = ReadBack(gpu)
        self.set_gaussians(gaussians)

    # --- parameters -------------------------------------------------------------------------------

    def set_gaussians(self, gaussians: GaussianSet) -> None:
        """New Gaussians (another count after pruning or densification): buffers made again, grid rebuilt."""
        import slangpy as spy

        if gaussians.count == 0:
            raise ValueError("a Gaussian scene needs at least one Gaussian")
        self.count = gaussians.count
        self.looks = gaussians.looks.copy()
        with device_memory(f"{gaussians.count:,} Gaussians"):
            self.values = spy.Tensor.from_numpy(self.gpu.device, gaussians.flat())
            self.grads = spy.Tensor.zeros(self.gpu.device, shape=(len(gaussians.flat()),), dtype=float)
            self.frames = spy.Tensor.zeros(self.gpu.device, shape=(FRAME_FLOATS * gaussians.count,), dtype=float)
            self._looks = spy.Tensor.from_numpy(self.gpu.device, np.ascontiguousarray(self.looks.reshape(-1)))
        # whether the channels texture the colours: the scene has them, and some Gaussian's record says how
        self.textured = self.channels is not None and any_textured(self.looks)
        # the shader's GaussianLook, made here (where the records change) rather than at every kernel's call
        self._look_struct = {"channels": self.channels.struct if self.textured else ChannelVolumes.empty_struct(),
                             "records": self._looks.storage.device_address, "textured": int(self.textured),
                             "highlights": self.highlights.shader_struct()}
        self.build_grid()

    def gaussians(self) -> GaussianSet:
        return GaussianSet.from_flat(np.asarray(self.values.to_numpy()), self.count, self.looks)

    def parameters(self) -> np.ndarray:
        """The flat parameters (without the trailing padding)."""
        return np.asarray(self.values.to_numpy())[: GAUSSIAN_FLOATS * self.count]

    def set_parameters(self, values: np.ndarray) -> None:
        """Same count, new values (the grid is rebuilt: the bounds may have moved)."""
        padded = np.concatenate([np.asarray(values, np.float32).reshape(-1), np.zeros(4, np.float32)])
        if padded.shape != (GAUSSIAN_FLOATS * self.count + 4,):
            raise ValueError(f"expected {GAUSSIAN_FLOATS * self.count} parameters, got {np.size(values)}")
        self.values.copy_from_numpy(padded)
        self.build_grid()

    def gradients(self) -> np.ndarray:
        return np.asarray(self.grads.to_numpy())[: GAUSSIAN_FLOATS * self.count]

    def zero_gradients(self) -> None:
        self.grads.copy_from_numpy(np.zeros(GAUSSIAN_FLOATS * self.count + 4, np.float32))

    def shader_struct(self) -> dict[str, Any]:
        return {"params": {"values": self.values.storage.device_address, "grads": self.grads.storage.device_address},
                "count": self.count, "densityScale": self.density_scale,
                "frames": self.frames.storage.device_address, "geometryThickness": self.geometry_thickness,
                "look": self._look_struct}

    # --- the grid ---------------------------------------------------------------------------------

    def grid_struct(self) -> dict[str, Any]:
        import slangpy as spy

        g = self.grid
        return {"cellStart": self._cell_start.storage.device_address,
                "cellList": self._cell_list.storage.device_address,
                "low": spy.float3(*g.low), "high": spy.float3(*g.high),
                "cellSize": spy.float3(*map(float, g.cell_size)), "dims": spy.int3(*g.dims)}

    def build_grid(self) -> None:
        """The Gaussians' frames (what the march reads of each), then count, scan and fill the cells' lists on the
        device; the lists' buffer grows when they need more. Called whenever the parameters change."""
        import slangpy as spy

        device, cells = self.gpu.device, self.grid.cells
        total = cells + 1  # the last start is the lists' length
        blocks = -(-total // SCAN_BLOCK)
        if self._cell_start is None:
            with device_memory(f"a grid of {cells:,} cells"):
                self._cell_start = spy.Tensor.zeros(device, shape=(total,), dtype="int")
                self._counts = spy.Tensor.zeros(device, shape=(total,), dtype="int")
                self._block_sums = spy.Tensor.zeros(device, shape=(blocks + 1,), dtype="int")
        if self._cell_list is None:
            self._cell_list = spy.Tensor.zeros(device, shape=(1,), dtype="int")
        m, scene = self.module, self.shader_struct()
        m.gaussianFrames(spy.grid((self.count,)), scene)  # what the march reads of each Gaussian
        m.gridClear(spy.grid((total,)), self._counts.storage.device_address, total)  # no upload a step
        m.gridCount(spy.grid((self.count,)), scene, self.grid_struct(), self._counts.storage.device_address)
        starts, counts, sums = (t.storage.device_address for t in (self._cell_start, self._counts, self._block_sums))
        m.gridScanBlocks(spy.grid((blocks,)), counts, starts, sums, total)
        m.gridScanTotals(spy.grid((1,)), sums, blocks)
        m.gridScanAdd(spy.grid((total,)), starts, sums, counts, total)
        needed = int(np.asarray(self._block_sums.to_numpy())[-1])
        if needed > self._list_capacity:
            with device_memory(f"the grid's lists of {needed:,} entries"):
                self._cell_list = spy.Tensor.zeros(device, shape=(max(needed, 1) + needed // 4,), dtype="int")
            self._list_capacity = needed + needed // 4
        m.gridFill(spy.grid((self.count,)), scene, self.grid_struct(), counts)

    def cell_lists(self) -> list[np.ndarray]:
        """Each cell's Gaussians, sorted (for checks)."""
        starts = np.asarray(self._cell_start.to_numpy())
        entries = np.asarray(self._cell_list.to_numpy())
        return [np.sort(entries[starts[c] : starts[c + 1]]) for c in range(self.grid.cells)]

    # --- rendering --------------------------------------------------------------------------------

    def upload_rays(self, origins: np.ndarray, directions: np.ndarray) -> Any:
        import slangpy as spy

        rays = np.concatenate([np.asarray(origins, np.float32).reshape(-1, 3),
                               np.asarray(directions, np.float32).reshape(-1, 3)], axis=1)
        with device_memory(f"{len(rays):,} rays"):
            return spy.Tensor.from_numpy(self.gpu.device, np.ascontiguousarray(rays.reshape(-1)))

    def render_rays(self, rays: Any, count: int) -> Any:
        """The sums of ``count`` uploaded rays (premultiplied RGB, alpha, Σ weight·normal, Σ weight·depth), as a
        device tensor of OUTPUTS floats a ray."""
        import slangpy as spy

        with device_memory(f"the colours of {count:,} rays"):
            results = spy.Tensor.zeros(self.gpu.device, shape=(OUTPUTS * count,), dtype=float)
        self._render_rays(rays, count, results)
        return results

    def _render_rays(self, rays: Any, count: int, results: Any) -> None:
        import slangpy as spy

        self.module.renderRays(spy.grid((count,)), self.shader_struct(), self.grid_struct(), self.march.to_shader(),
                               rays.storage.device_address, count, results.storage.device_address)

    def backward_rays(self, rays: Any, count: int, results: Any, d_results: np.ndarray | Any, groups: int = 1) -> None:
        """Add the gradients of a loss whose ∂/∂(rgb, alpha) per ray is ``d_results``: (count, 4) on the host, or
        a device tensor of OUTPUTS floats a ray (the depth and normal sums take no gradient). ``groups``: the rays
        are that many groups of neighbouring pixels (a batch's patches), which the threads take in turn so that
        neighbouring threads' gradients go to different Gaussians (the sums are the same)."""
        import slangpy as spy

        if groups < 1 or count % groups:
            raise ValueError(f"{count} rays do not make {groups} groups of one size")
        if isinstance(d_results, np.ndarray):
            padded = np.zeros((count, OUTPUTS), np.float32)
            padded[:, :4] = np.asarray(d_results, np.float32).reshape(count, 4)
            d_results = spy.Tensor.from_numpy(self.gpu.device, padded.reshape(-1))
        self.module.renderRaysBackward(spy.grid((count,)), self.shader_struct(), self.grid_struct(),
                                       self.march.to_shader(), rays.storage.device_address, count, groups,
                                       results.storage.device_address, d_results.storage.device_address)

    # --- training batches -------------------------------------------------------------------------

    def patch_rays(self, batch: GaussianBatch, cameras: Any, rows: np.ndarray, size: int) -> None:
        """The rays of patches ``rows`` (view, x0, y0) of ``size``² pixels made on the device into ``batch``;
        ``cameras`` a tensor of render/patches.pack_cameras."""
        import slangpy as spy

        if len(rows) * size * size != batch.count:
            raise ValueError(f"{len(rows)} patches of {size}² pixels for a batch of {batch.count} rays")
        batch.patches = spy.Tensor.from_numpy(self.gpu.device, np.ascontiguousarray(rows, np.int32).reshape(-1))
        batch.groups = len(rows)
        self.module.gaussianPatchRays(spy.grid((len(rows), size, size)), cameras.storage.device_address,
                                      batch.patches.storage.device_address, size, batch.rays.storage.device_address)

    def forward(self, batch: GaussianBatch) -> None:
        self._render_rays(batch.rays, batch.count, batch.sums)

    def backward(self, batch: GaussianBatch) -> None:
        """Add the gradients of the loss whose ∂/∂sums the batch holds (``d_sums``), all on the device; on a GPU
        its patches' rays taken in turn (``backward_rays``' groups) unless NEURALRAYCAST_GAUSSIAN_GROUPS=0. A
        software device takes them in order: its lanes gain from neighbouring rays' shared reads, and no atomics
        queue there (docs/gaussians.md)."""
        grouped = BACKWARD_GROUPS and not self.gpu.report.software
        self.backward_rays(batch.rays, batch.count, batch.sums, batch.d_sums, batch.groups if grouped else 1)

    def accumulate_position_gradients(self, stats: Any) -> None:
        """Add each Gaussian's |∂loss/∂position| (and 1 where it is not zero) into ``stats`` (2 floats a
        Gaussian), before Adam takes the gradients."""
        import slangpy as spy

        self.module.accumulatePositionGradients(spy.grid((self.count,)), self.shader_struct(),
                                                stats.storage.device_address)

    # --- pictures ---------------------------------------------------------------------------------

    def render_sums(self, camera: Camera, normals: bool = False) -> np.ndarray:
        """A camera's per-pixel sums, (height, width, OUTPUTS); ``normals``: with the normal sums."""
        import slangpy as spy

        pixels = camera.width * camera.height
        with device_memory(f"a {camera.width} x {camera.height} picture"):
            results = spy.Tensor.zeros(self.gpu.device, shape=(OUTPUTS * pixels,), dtype=float)
        self.module.renderCamera(tiled(camera), self.shader_struct(), self.grid_struct(),
                                 self.march.to_shader(normals), camera.to_shader(), results.storage.device_address)
        return np.asarray(results.to_numpy()).reshape(camera.height, camera.width, OUTPUTS)

    def render(self, camera: Camera) -> np.ndarray:
        """A camera's picture, (height, width, 4): premultiplied RGB and alpha."""
        return self.render_sums(camera)[..., :4]

    def render_image(self, camera: Camera) -> RenderedImage:
        """A camera's G-buffer as the field's renderer gives it: premultiplied RGBA, the expected depth along
        the ray (mm, 0 where nothing is seen) and the unit normal of the density (-∇σ / |∇σ|, zero there), made on
        the device as the field's frame's planes (shaders/pixel_planes.slang) and read back as they are."""
        import slangpy as spy

        pixels = camera.width * camera.height
        if self._planes is None or self._planes.shape[0] != PLANE_FLOATS * pixels:
            self._planes = None
            with device_memory(f"a {camera.width} x {camera.height} G-buffer"):
                self._planes = spy.Tensor.zeros(self.gpu.device, shape=(PLANE_FLOATS * pixels,), dtype="float")
        self.module.renderCameraPlanes(tiled(camera), self.shader_struct(), self.grid_struct(),
                                       self.march.to_shader(normals=True), camera.to_shader(),
                                       self._planes.storage.device_address)
        return image_from_planes(self._read_back.read(self._planes), camera.height, camera.width)

    def render_picture(self, camera: Camera) -> np.ndarray:
        """One view as a screen shows it (the field renderer's ``render_picture``): (H, W, 4) straight-alpha
        bytes, the rows from the bottom, packed on the device so that a word a pixel is read back."""
        import slangpy as spy

        pixels = camera.width * camera.height
        if self._picture is None or self._picture.shape[0] != pixels:
            self._picture = None
            with device_memory(f"a {camera.width} x {camera.height} picture"):
                self._picture = spy.Tensor.zeros(self.gpu.device, shape=(pixels,), dtype="float")  # a word a pixel
        self.module.renderCameraPacked(tiled(camera), self.shader_struct(), self.grid_struct(),
                                       self.march.to_shader(), camera.to_shader(),
                                       self._picture.storage.device_address)
        return self._read_back.read(self._picture).view(np.uint8).reshape(camera.height, camera.width, 4)
