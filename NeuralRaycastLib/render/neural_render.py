"""The differentiable renderer: any trainable scene (the neural field, or analytic spheres in the tests)
rendered with the image formation model of the reference renderer, forward and backward.

A batch of rays goes through a few small kernels rather than one large one:

1. rays from a camera or from training patches (shaders/ray_samples.slang),
2. sample points every ``step`` mm on the occupied part of each ray (an :class:`Occupancy` grid), listed,
3. the scene's distances at every sample (one thread per entry of that list; shaders/diff_scene.slang),
4. work lists of the shaded segments and of the samples at the ends of every composited one (a faint
   segment borrows a shaded neighbour's surface values; shaders/segment_lists.slang), then normals and
   appearance on the first list (one thread per entry),
5. compositing front to back into per-ray sums (shaders/composite.slang),
6. backward: compositing's gradient per stored value (one thread per composited segment, from what the
   forward pass kept), then the scene's backward pass over both lists.

Keeping the networks out of the ray loop keeps every kernel small (quick to compile, also on a CPU
device) and lets all samples of a batch run in parallel; the lists keep every thread of a wave busy
(most samples lie in empty space, and tensor-core networks need whole waves). A training batch's host reads
each list's length before the passes over it; a rendered view's does not wait: its passes take the entries in
turn over a number of threads fixed beforehand, and the lengths are read with the frame. A training batch has
room for ``max_samples`` samples of every ray; a rendered view's band lays out only the samples its rays take,
counted on the device first (one number read back a band), so a band of a large view fits a small memory budget.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..gpu.device import (
    GpuContext,
    GpuMemoryError,
    PassClock,
    ReadBack,
    device_memory,
    device_memory_total,
    memory_budget,
)
from .camera import Camera
from .image import PLANE_FLOATS, RenderedImage, image_from_planes
from .occupancy import Occupancy
from .sample_buffers import OUTPUTS, RayBatch, RayTiles, address, grown
from .scene import TrainableScene, WorkLists, list_launch

#: Device memory the rays of one band of a rendered view may take: on a GPU a tenth of its memory, at least
#: the first figure and at most the second; on a CPU device the third; never more than the memory budget's
#: share for a band (gpu/memory_budget.py), which leaves these sizes as they are on a GPU with memory to spare.
#: Fewer, larger bands mean fewer passes and waits, and render a frame faster, with or without mesh shadows
#: (BENCHMARKS.md); but a band's buffers stand beside all else the process holds (a trained field, its
#: training's buffers), so a large view is drawn in bands of no more than the second figure.
BAND_BYTES = (1 << 30, 3 << 30, 1 << 30)
#: A band's largest buffer (its sample slots' arrays) stays below this: a 1024² view in one band at 256 samples
#: a ray, whose slots would take 10 GiB, cannot be created even on a GPU with most of its memory free.
MAX_BUFFER_BYTES = 4 << 30
#: How much more than the views rendered so far took a band is sized for: its memory per ray (a band that counts
#: more than its share is drawn again in fewer rows), and its room for shaded segments per sample slot (a band
#: that lists more renders the view again), so that a view a little fuller than the last fits the same bands and
#: room. What a renderer's views of a size took is kept at its most (a view of another side, then this one again,
#: is sized as before), and the buffers for the next view of the same size are made once a view was rendered.
BAND_HEADROOM = 1.1
ROOM_HEADROOM = 1.25
#: View sizes whose band sizes a renderer keeps (the most recently drawn).
KEPT_VIEW_SIZES = 16
#: Room for shaded segments per compact sample slot of a band until a view was counted.
SHADED_PER_SLOT = 0.5
#: Threads per ray of a rendered band's launches over its lists while their lengths are not known (forward,
#: ``counted=False``): the networks' passes, then the shadow rays (whose loops over the list diverge more).
LIST_THREADS_PER_RAY = 1
SHADOW_THREADS_PER_RAY = 4
#: A segment adding less than this to its pixel's opacity (transmittance × opacity) is not composited. On
#: the sample case this leaves out about 40 % of the non-empty segments and at most 0.003 of a pixel's opacity.
MIN_SEGMENT_WEIGHT = 1e-4
#: A composited segment adding less than this is not shaded: it takes the surface values of a shaded
#: segment of the same crossing (shaders/segment_lists.slang), while its opacity counts in full.
SHADE_WEIGHT = 1e-3


class DiffRenderer:
    """Renders a :class:`TrainableScene` and sends image gradients back into its parameters."""

    def __init__(
        self,
        gpu: GpuContext,
        scene: TrainableScene,
        look: dict,
        lighting: dict,
        settings: dict,
        occupancy: Occupancy,
        max_samples: int = 256,
        min_weight: float = MIN_SEGMENT_WEIGHT,
        shade_weight: float = SHADE_WEIGHT,
    ) -> None:
        self.gpu, self.scene = gpu, scene
        self.min_weight = min_weight  # 0: composite every non-empty segment
        self.shade_weight = shade_weight  # at most min_weight: shade every composited segment (exact)
        self.shading = {"look": look, "lighting": lighting, "settings": settings}
        self.look, self.settings = look, settings
        self.max_samples = max_samples
        self.rays_module = gpu.load_module("ray_samples", scene.structures)
        self.composite_module = gpu.load_module("composite", scene.structures)
        self.lists_module = gpu.load_module("segment_lists", scene.structures)
        self._batch: RayBatch | None = None
        self._band_limit = 1 << 62  # rays per band, lowered where the device could not hold a band
        # what views of this size took at the most (_learn_band_sizes; None: not counted yet, a ray may take
        # max_samples), kept for each view size a renderer has drawn (a smaller view's rays take more slots each)
        self._ray_bytes: float | None = None  # device memory per ray
        self._slots_per_ray: float | None = None
        self._shaded_per_slot = SHADED_PER_SLOT
        self._sizes_by_view: dict[tuple[int, int], tuple[float, float, float]] = {}
        self._view_size: tuple[int, int] | None = None
        self.band_work: list[tuple[int, int, int]] = []  # each band's rays, slots and bytes (camera_bands)
        self._device_bytes: int | None = None  # the GPU's memory (0: not known), read at the first band
        self._frame: Any = None  # a whole view's sums on the device (render)
        self._planes: Any = None  # and its G-buffer
        self._picture: Any = None  # and its picture as bytes (render_picture)
        self._band_counts: Any = None  # each band's list counts, read with the frame (render)
        self._read_back = ReadBack(gpu)
        self.mesh_shadows = None
        self.set_occupancy(occupancy)
        self.ray_count = 0
        self._tiles = RayTiles(0, 0)

    @property
    def box(self) -> np.ndarray:
        """(2, 3) RAS box where samples are placed (from the march settings)."""
        return np.array([list(self.settings["boxMin"]), list(self.settings["boxMax"])], np.float64)

    @property
    def epsilon(self) -> float:
        return float(self.settings["epsilon"])

    def set_occupancy(self, occupancy: Occupancy) -> None:
        self.occupancy = occupancy
        self._occupancy_tensors, self._occupancy = occupancy.upload(self.gpu)

    def set_mesh_shadows(self, shadows) -> None:
        """Shadow the key light with meshes (a :class:`~NeuralRaycastLib.render.mesh_shadows.MeshShadows`, e.g. of
        the learned surfaces), or not (None). The visibility is a fixed mask: no gradient flows through it."""
        self.mesh_shadows = shadows
        if shadows is not None and not hasattr(self, "_shadow_module"):
            self._shadow_module = self.gpu.load_module("segment_shadows", self.scene.structures)

    def forget_view_sizes(self) -> None:
        """Size the next views' bands afresh (:meth:`_learn_band_sizes`): after the occupancy changed much, as
        from training's coarse cells to the pictures' fine ones, whose rays take a fraction of the slots; else
        the pictures' views would make room for what training's views took."""
        self._ray_bytes = self._slots_per_ray = None
        self._shaded_per_slot = SHADED_PER_SLOT
        self._sizes_by_view.clear()

    def release_batch(self) -> None:
        """Free the sample buffers (the next batch makes them again, at its size): after the device could not
        hold a batch, before a smaller one is tried."""
        self._batch = None

    def batch(self, rays: int) -> RayBatch:
        """Buffers for ``rays`` rays (the last batch if it is large enough; GpuMemoryError if the device cannot
        hold them)."""
        if self._batch is None or self._batch.capacity < rays:
            smaller, self._batch = self._batch, None
            megabytes = rays * RayBatch.bytes_per_ray(self.max_samples, self.scene.structures) / 2**20
            with device_memory(f"the sample buffers of {rays:,} rays ({megabytes:,.0f} MB)"):
                batch = RayBatch(self.gpu, rays, self.max_samples, self.scene.structures)
            if smaller is not None:
                batch.take_room(smaller)  # its slots' and segments' buffers: only the rays' are made again
            self._batch = batch
        return self._batch

    # rays ---------------------------------------------------------------------------------------------
    def camera_rays(self, camera: Camera, first_row: int = 0, rows: int | None = None,
                    compact: bool = False) -> RayBatch:
        """Rays of ``rows`` rows of a view from ``first_row``; ``compact``: their slots laid out compact, reserved
        by :meth:`count_samples` before the :meth:`forward` (a rendered band), else strided (room for every
        ray's ``max_samples``)."""
        import slangpy as spy

        rows = camera.height - first_row if rows is None else rows
        batch = self.batch(rows * camera.width)
        self.rays_module.cameraRays(spy.grid((rows, camera.width)), camera.to_shader(), first_row,
                                    batch.rays.storage.device_address)
        self.ray_count = rows * camera.width
        self._tiles = RayTiles(camera.width, rows)
        batch.set_rays(self.ray_count, self._tiles if compact else None, self.segment_words())
        return batch

    def patch_rays(self, cameras: Any, patches: np.ndarray, size: int) -> RayBatch:
        """Rays of patches (view, x0, y0) of ``size``² pixels; ``cameras`` a tensor of packed cameras."""
        import slangpy as spy

        batch = self.batch(len(patches) * size * size)
        self._patches = spy.Tensor.from_numpy(self.gpu.device, np.ascontiguousarray(patches, np.int32).reshape(-1))
        struct = {"cameras": cameras.storage.device_address, "patches": self._patches.storage.device_address,
                  "size": size}
        self.rays_module.patchRays(spy.grid((len(patches), size, size)), struct, batch.rays.storage.device_address)
        self.ray_count = len(patches) * size * size
        batch.set_rays(self.ray_count)
        self._tiles = RayTiles(size, len(patches) * size)
        return batch

    # passes -------------------------------------------------------------------------------------------
    def forward(self, batch: RayBatch, timings: dict[str, float] | None = None, sums_at: int | None = None,
                for_backward: bool = False, counted: bool = True, backward_follows: bool = True) -> None:
        """Samples, scene values and per-ray sums of the current rays (kept for :meth:`backward`).
        ``timings``: add each pass's seconds there (waiting for the device after each; for profiling).
        ``sums_at``: device address the sums go to instead of ``batch.sums`` (a band of a whole frame).
        ``for_backward``: compositing also keeps what :meth:`backward` needs (else the backward composites
        the batch again first).
        ``counted``: the host reads each list's length before the passes over it (``batch.lists``), launches
        one thread per entry and makes room for every shaded segment's values. Else (a rendered view's bands) it
        never waits: one thread per ray takes every launched-th entry, the shaded segments have the room made
        before, and ``batch.lists`` is unknown until the view's frame is read (:meth:`render`).
        ``backward_follows``: list the samples a backward pass sends gradients to (the touched list); a
        rendered view's bands do without.
        A batch of strided slots gets room for ``max_samples`` of every ray here; one of compact slots
        (:meth:`camera_rays` ``compact``, a rendered band) was counted and given its room before
        (:meth:`count_samples`, :meth:`make_room`)."""
        import slangpy as spy

        clock = PassClock(self.gpu, timings)
        launch, tiles = self._tiles.launch(), self._tiles.struct()
        if not batch.compact:
            batch.reserve_slots(self.ray_count * self.max_samples)
            if backward_follows:
                batch.reserve_touched(self.ray_count * self.max_samples)
        self.rays_module.clearLists(spy.grid((3,)), batch.struct, 0)
        bits = batch.segment_bits.storage.device_address if batch.compact else 0
        self.rays_module.placeSamples(launch, batch.struct, self._occupancy, self.settings, tiles, bits)
        clock.lap("place samples")
        # counted, exactly the listed samples: waves past the list's end would leave at once, but launching a
        # ray's every possible slot makes this pass much slower (BENCHMARKS.md)
        sampled = int(batch.list_counts.to_numpy()[2]) if counted else LIST_THREADS_PER_RAY * self.ray_count
        if sampled:
            self.scene.distances(list_launch(batch.struct, sampled), batch.struct)
        clock.lap("distances")
        room = (1 << 31) - 1 if counted else batch.surface_capacity  # (counted: the room is made next)
        self.lists_module.listSegments(launch, batch.struct, self.look, self.settings,
                                       self.min_weight, self.shade_weight, tiles, room, backward_follows)
        if counted:
            batch.lists = WorkLists(*(int(c) for c in batch.list_counts.to_numpy()[:3]))
            batch.reserve_surfaces(batch.lists.shaded)
        shaded = batch.lists.shaded if counted else LIST_THREADS_PER_RAY * self.ray_count
        clock.lap("work lists")
        if shaded:
            self.scene.surface(list_launch(batch.struct, shaded), batch.struct)
        clock.lap("normals and appearance")
        batch.struct["shadows"] = int(self.mesh_shadows is not None)
        if self.mesh_shadows is not None and shaded:
            key = self.shading["lighting"]["keyDirection"]
            grid = self.mesh_shadows.light_grid((key.x, key.y, key.z))
            threads = shaded if counted else SHADOW_THREADS_PER_RAY * self.ray_count
            self._shadow_module.segmentVisibility(list_launch(batch.struct, threads), batch.struct, self.shading,
                                                  self.mesh_shadows.struct, grid, self.mesh_shadows.settings)
            clock.lap("mesh shadows")
        self._composite(batch, batch.sums.storage.device_address if sums_at is None else sums_at, for_backward)
        clock.lap("composite")

    def count_samples(self, batch: RayBatch, timings: dict[str, float] | None = None, read: bool = True) -> int | None:
        """The compact layout's first passes over the current rays (:meth:`camera_rays` ``compact``): each ray's
        samples counted, its tile's rows of slots reserved. Returns the slots reserved, read back: the one wait
        of a rendered band, before its buffers are made to that size (:meth:`make_room`); not ``read``: None, the
        count stays on the device (a band drawn on the room kept for its view: :meth:`camera_bands`)."""

        clock = PassClock(self.gpu, timings)
        self.rays_module.countSamples(self._tiles.launch(), batch.struct, self._occupancy, self.settings,
                                      self._tiles.struct(), batch.segment_bits.storage.device_address)
        slots = self._reserve_tiles(batch, read)
        clock.lap("place samples")
        return slots

    def _reserve_tiles(self, batch: RayBatch, read: bool = True) -> int | None:
        import slangpy as spy

        self.rays_module.clearLists(spy.grid((1,)), batch.struct, 3)
        tiles = self._tiles.count()
        self.rays_module.reserveTiles(WorkLists.launch(tiles), batch.struct, self._tiles.struct(), tiles,
                                      batch.slot_capacity // RayTiles.PIXELS)
        return int(batch.list_counts.to_numpy()[3]) if read else None

    def make_room(self, batch: RayBatch, slots: int, shaded: int, allowance: int | None = None) -> None:
        """Buffers for ``slots`` compact slots (:meth:`count_samples`) and ``shaded`` shaded segments; where the
        slots' buffers grew, the tiles reserve their rows again in them (the same count). Buffers that grow take
        some room to spare, but not beyond ``allowance`` bytes for the band (a band's memory, :meth:`_band_bytes`)."""
        most_slots, most_shaded = self._room_within(self.ray_count, slots, shaded, allowance)
        # grown at once by the quarter a second growth would add when the next view of this size is given its
        # room (_make_room_for_next_view): one allocation, not two in a row
        if shaded > batch.surface_capacity:
            batch.reserve_surfaces(grown(shaded, shaded, most_shaded), most_shaded)
        if slots > batch.slot_capacity:
            batch.reserve_slots(grown(slots, slots, most_slots), most_slots)
            self._reserve_tiles(batch)

    def _room_within(self, rays: int, slots: int, shaded: int, allowance: int | None) -> tuple[int | None, int | None]:
        """The most slots and shaded segments a band of ``rays`` rays may make room for within ``allowance`` bytes,
        in the proportion of ``slots`` to ``shaded`` (None, None: no limit)."""
        if allowance is None:
            return None, None
        need = RayBatch.band_bytes(rays, slots, shaded, self.scene.structures, self.segment_words())
        scale = allowance / max(need, 1)
        return int(slots * scale), int(shaded * scale)

    def _composite(self, batch: RayBatch, sums_at: int, for_backward: bool) -> None:
        """Composite the batch into the sums at ``sums_at``; ``for_backward``: also keep what the backward
        needs, in buffers sized for the trained rays."""
        if for_backward:
            batch.keep_gradients(self.ray_count)
        batch.struct["kept"] = address(batch.kept) if for_backward else 0
        self.composite_module.compositeRay(self._tiles.launch(), batch.struct, self.shading, sums_at,
                                           self._tiles.struct())
        batch.kept_for_backward = for_backward

    def sums(self, batch: RayBatch) -> np.ndarray:
        return np.asarray(batch.sums.to_numpy()).reshape(-1, OUTPUTS)[: self.ray_count]

    def backward(self, batch: RayBatch, d_sums: np.ndarray, geometry: bool = True) -> None:
        """Add ∂L/∂parameters to the scene's gradient buffer, given ∂L/∂sums (rays, OUTPUTS) of the last
        :meth:`forward`. With ``geometry=False`` (a scene with ``backward_appearance``) only the appearance
        gets gradients, much faster while the geometry is frozen."""
        self.composite_backward(batch, d_sums)
        self.scene_backward(batch, geometry)

    def composite_backward(self, batch: RayBatch, d_sums: np.ndarray) -> None:
        """First half of :meth:`backward`: ∂L/∂(every stored sample value), in the batch's gradient buffers."""
        n = self.ray_count
        padded = np.zeros((batch.capacity, OUTPUTS), np.float32)
        padded[:n] = np.asarray(d_sums, np.float32).reshape(n, OUTPUTS)
        batch.d_sums.copy_from_numpy(padded.reshape(-1))
        self.composite_backward_on_device(batch)

    def composite_backward_on_device(self, batch: RayBatch) -> None:
        """:meth:`composite_backward` with ∂L/∂sums already in ``batch.d_sums`` (written there by a loss
        kernel: nothing goes through the host)."""
        if not batch.kept_for_backward:  # (and each backward adds to gradients its forward zeroed)
            self._composite(batch, batch.sums.storage.device_address, for_backward=True)
        if batch.lists.touched:
            self.composite_module.compositeSegmentBackward(WorkLists.launch(batch.lists.touched), batch.struct,
                                                           self.shading, batch.sums.storage.device_address,
                                                           batch.d_sums.storage.device_address)
        batch.kept_for_backward = False

    def scene_backward(self, batch: RayBatch, geometry: bool = True, timings: dict[str, float] | None = None) -> None:
        """Second half of :meth:`backward`: the sample values' gradients into the scene's parameters
        (``timings``: see :meth:`forward`)."""
        if not batch.lists.shaded:
            return
        if geometry:
            self.scene.backward(batch.lists, batch.struct, timings)
        else:
            self.scene.backward_appearance(batch.lists, batch.struct, timings)

    def segment_albedo(self, batch: RayBatch) -> SegmentAlbedo:
        """The albedo of every shaded segment of the last :meth:`forward` (the shaded work list; the faint
        segments that borrow from them hold no albedo of their own) with its optical depth per structure (how
        much of it is seen), for losses on the albedo itself."""
        k, shaded = self.scene.structures, batch.lists.shaded
        slots = np.asarray(batch.shaded_slots.to_numpy())[:shaded].astype(np.int64)
        distances = np.asarray(batch.distances.to_numpy()).reshape(-1, k)
        surface = batch.surface_values(batch.surface, shaded)
        ends = np.stack([distances[slots], distances[batch.next_slots(slots)]]).astype(np.float64)
        inside = 1.0 / (1.0 + np.exp(np.clip(ends / self.epsilon, -60.0, 60.0)))
        weight = np.asarray(self.look["opticalDepth"][:k], np.float64) * np.abs(inside[1] - inside[0])
        return SegmentAlbedo(slots, surface[:, 3 * k:6 * k].reshape(-1, k, 3), weight)

    def add_albedo_gradient(self, batch: RayBatch, segments: SegmentAlbedo, d_albedo: np.ndarray) -> None:
        """Add ∂L/∂albedo of those segments to the batch's surface gradients (between the two halves of the
        backward)."""
        k = self.scene.structures
        grads = batch.surface_planes(batch.surface_grads).copy()
        grads[3 * k:6 * k, :len(segments.slots)] += np.asarray(d_albedo, np.float32).reshape(-1, 3 * k).T
        batch.surface_grads.copy_from_numpy(grads.reshape(-1))

    def sample_counts(self, batch: RayBatch) -> np.ndarray:
        return np.asarray(batch.counts.to_numpy())[: self.ray_count]

    # whole images -------------------------------------------------------------------------------------
    def band_rays(self) -> int:
        """Rays per band of a rendered view: as many as :data:`BAND_BYTES` and the memory budget hold (each buffer
        under :data:`MAX_BUFFER_BYTES`), or as a band that fitted when a larger one did not (:meth:`camera_bands`).
        A ray is counted at ``max_samples`` samples until a view's bands were counted, then at what their rays
        took (:meth:`_learn_band_sizes`)."""
        if self._ray_bytes is None:
            per_ray = RayBatch.bytes_per_ray(self.max_samples, self.scene.structures)
        else:
            per_ray = math.ceil(self._ray_bytes * BAND_HEADROOM)
        fitting = self._band_bytes() // per_ray
        return min(self._band_limit, self._creatable_rays(), max(1, fitting))

    def _creatable_rays(self) -> int:
        """The most rays a batch may have with its largest buffer, its slots' (sample_buffers.py's slot_arrays),
        under MAX_BUFFER_BYTES."""
        slots = self.max_samples if self._slots_per_ray is None else self._slots_per_ray * BAND_HEADROOM
        slot_bytes = RayBatch.slot_bytes(self.scene.structures)
        return max(1, (MAX_BUFFER_BYTES - 1) // math.ceil(min(slots, self.max_samples) * slot_bytes))

    def _learn_band_sizes(self, bands: list[tuple[int, int, int]]) -> None:
        """Size later views' bands and their room for shaded segments by a view's bands: (rays, slots reserved,
        shaded segments) each, where the most per ray and per slot of them, with :data:`BAND_HEADROOM` and
        :data:`ROOM_HEADROOM`, say."""
        counted = [(rays, slots, shaded) for rays, slots, shaded in bands if rays and slots]
        if not counted:
            return
        self._shaded_per_slot = max(shaded / slots for _rays, slots, shaded in counted) * ROOM_HEADROOM
        self._slots_per_ray = max(slots / rays for rays, slots, _shaded in counted)
        sizes = (max(self._band_need(rays, slots) / rays for rays, slots, _shaded in counted), self._slots_per_ray,
                 self._shaded_per_slot)
        if self._view_size is None:
            self._ray_bytes = sizes[0]
            return
        kept = self._sizes_by_view.pop(self._view_size, sizes)
        self._ray_bytes, self._slots_per_ray, self._shaded_per_slot = (max(a, b) for a, b in zip(sizes, kept,
                                                                                                 strict=True))
        # (the most of each may come from different views: a band holds the most slots, and the most shaded
        # segments a slot, together)
        rays = 1 << 16
        self._ray_bytes = max(self._ray_bytes, self._band_need(rays, math.ceil(self._slots_per_ray * rays)) / rays)
        self._sizes_by_view[self._view_size] = (self._ray_bytes, self._slots_per_ray, self._shaded_per_slot)
        while len(self._sizes_by_view) > KEPT_VIEW_SIZES:
            del self._sizes_by_view[next(iter(self._sizes_by_view))]

    def _size_for_view(self, camera: Camera) -> None:
        """Size the bands of a view by what views of its size took at the most, where one was drawn (else by the
        last view's, of another size)."""
        self._view_size = (camera.width, camera.height)
        kept = self._sizes_by_view.get(self._view_size)
        if kept is not None:
            self._ray_bytes, self._slots_per_ray, self._shaded_per_slot = kept

    def _make_room_for_next_view(self, camera: Camera, rays_per_pass: int | None) -> None:
        """Once a view was rendered and counted, the buffers a view of its size takes by what the views so far
        took (:meth:`_learn_band_sizes`), with :data:`BAND_HEADROOM` to spare: the next view's bands, the same view
        again or one a little fuller, make none (the first view, sized at ``max_samples`` a ray, may have been
        rendered in more, smaller bands). A device that cannot hold them leaves them to the next view's bands
        (which render in fewer rows)."""
        if self._slots_per_ray is None:
            return
        per_pass = min(rays_per_pass or self.band_rays(), self._creatable_rays())
        rows = even_bands(camera.height, max(1, per_pass // camera.width))
        rays = rows * camera.width
        slots = math.ceil(self._slots_per_ray * BAND_HEADROOM * rays)
        shaded = self._shaded_room(slots)
        most_slots, most_shaded = self._room_within(rays, slots, shaded, self._band_bytes())
        try:
            if self._batch is None or self._batch.capacity < rays:
                self.batch(rays).reserve_tiles(rays, RayTiles(camera.width, rows), self.segment_words())
            self._batch.reserve_surfaces(shaded, most_shaded, halves=True)  # (a rendered band's)
            self._batch.reserve_slots(slots, most_slots)
        except GpuMemoryError:
            self._batch = None

    def _band_need(self, rays: int, slots: int) -> int:
        """Device memory of a rendered band of ``rays`` rays in ``slots`` compact slots, with room for the shaded
        segments its slots are expected to hold."""
        return RayBatch.band_bytes(rays, slots, self._shaded_room(slots), self.scene.structures, self.segment_words())

    def segment_words(self) -> int:
        """Words a ray's occupied segments take, a bit each (ray_samples.slang's countSamples): enough for the
        box's diagonal in steps, and one more for rounding."""
        low, high = self.box
        segments = math.ceil(float(np.linalg.norm(high - low)) / float(self.settings["step"])) + 1
        return -(-segments // 32) + 1

    def _shaded_room(self, slots: int) -> int:
        return math.ceil(slots * self._shaded_per_slot)

    def _band_bytes(self) -> int:
        least, most, software = BAND_BYTES
        share = memory_budget(self.gpu).share("band")
        if self.gpu.report.software:
            return min(software, share)
        if self._device_bytes is None:
            self._device_bytes = device_memory_total(self.gpu) or 0
        return min(most, max(least, self._device_bytes // 10), share)

    def camera_bands(self, camera: Camera, rays_per_pass: int | None = None,
                     timings: dict[str, float] | None = None, frame: Any = None, counted: bool = True,
                     kept_room: bool = False) -> Iterator[tuple[int, int, RayBatch]]:
        """A view's rays in bands of rows (``rays_per_pass`` rays at most, default :meth:`band_rays`; never
        more than a batch's buffers can be created for), so memory stays bounded: (first row, rows, batch)
        after its :meth:`forward` (``timings``, ``counted``: see there; no backward follows, so the batch has
        no touched list). With ``frame`` (a device tensor of the view's sums) each band's sums go to their rows
        of it. A band's slots are laid out compact: its rays' samples are counted first, and a band whose count
        needs more than a band's memory (:meth:`_band_bytes`) renders in fewer rows. A band the device cannot
        hold is rendered in halves, down to one row (GpuMemoryError there). ``band_work`` ends as each band's
        rays, slots and the bytes it was expected to need. ``kept_room`` (a view not ``counted``): where views of
        this size were drawn before and the buffers made for the next (:meth:`_room_kept`), a band's count stays
        on the device and the band is drawn on that room, so the host never waits inside the frame; its slots
        and bytes are None in ``band_work`` until the frame is read (:meth:`_render_frame`, which draws the view
        again, counted, where a band reserved more slots than the room: those rays placed no samples)."""
        rays_per_pass = min(rays_per_pass or self.band_rays(), self._creatable_rays())
        rows_per_pass = even_bands(camera.height, max(1, rays_per_pass // camera.width))
        allowance, slot_bytes = self._band_bytes(), RayBatch.slot_bytes(self.scene.structures)
        self.band_work = []
        first = 0
        while first < camera.height:
            rows = min(rows_per_pass, camera.height - first)
            rays = rows * camera.width
            at = None if frame is None else frame.storage.device_address + first * camera.width * OUTPUTS * 4  # float32
            try:
                batch = self.camera_rays(camera, first, rows, compact=True)
                if kept_room and not counted and self._room_kept(batch, rays):
                    self.count_samples(batch, timings, read=False)
                    self.forward(batch, timings, sums_at=at, counted=False, backward_follows=False)
                    self.band_work.append((rays, None, None))
                    yield first, rows, batch
                    first += rows
                    continue
                slots = self.count_samples(batch, timings)
                need = self._band_need(rays, slots)
                if rows > 1 and (need > allowance or slots * slot_bytes >= MAX_BUFFER_BYTES):
                    # more samples than a band's memory holds: fewer rows, for this band and the next ones
                    self._ray_bytes = max(self._ray_bytes or 0.0, need / rays)
                    rows_per_pass = whole_tiles(max(1, min(rows * allowance // need, rows - 1,
                                                           rows * (MAX_BUFFER_BYTES - 1) // (slots * slot_bytes))))
                    continue
                self.make_room(batch, slots, self._shaded_room(slots), allowance)
                self.forward(batch, timings, sums_at=at, counted=counted, backward_follows=False)
            except GpuMemoryError:
                if rows == 1:
                    raise
                # the device could not hold this band: half as many rows, for this view and the next ones
                self._batch = None
                rows_per_pass = max(1, rows // 2)
                self._band_limit = rows_per_pass * camera.width
                continue
            self.band_work.append((rays, slots, need))
            yield first, rows, batch
            first += rows

    def _room_kept(self, batch: RayBatch, rays: int) -> bool:
        """Whether ``batch`` has the room views of the current size took for a band of ``rays`` rays (made after
        the last of them: :meth:`_make_room_for_next_view`), so that the band may be drawn without its count."""
        if self._view_size not in self._sizes_by_view:  # (where it is, _size_for_view took its sizes)
            return False
        slots = math.ceil(self._slots_per_ray * rays)
        return batch.slot_capacity >= slots and batch.surface_capacity >= self._shaded_room(slots)

    def render(self, camera: Camera, rays_per_pass: int | None = None,
               timings: dict[str, float] | None = None) -> RenderedImage:
        """One view (``timings``: see :meth:`forward`). The bands' sums stay on the device, where the
        G-buffer is made from them (shaders/composite.slang's finishPixel); one read-back per view. The host
        never waits for a band's list counts (:meth:`forward` ``counted=False``); where a band listed more
        shaded segments than it had room for, the view renders again, counted (and later views have the room)."""
        return image_from_planes(self._frame_planes(camera, rays_per_pass, timings), camera.height, camera.width)

    def render_on_device(self, camera: Camera, rays_per_pass: int | None = None):
        """One view's G-buffer planes (image.py's PLANE_FLOATS per pixel, RGBA first), left on the device for
        work there (render/view_score.py); the tensor is the renderer's own, overwritten by its next view."""
        self._frame_planes(camera, rays_per_pass, read=False)
        return self._planes

    def render_picture(self, camera: Camera) -> np.ndarray:
        """One view as a screen shows it: (H, W, 4) straight-alpha bytes, the rows from the bottom (as VTK
        images start). Made on the device from the G-buffer (shaders/composite.slang's packPicture), so only a
        quarter of the colour plane's bytes is read back and nothing is converted on the host (the live view)."""
        import slangpy as spy

        self._frame_planes(camera, read=False)
        pixels = camera.height * camera.width
        if self._picture is None or self._picture.shape[0] != pixels:
            self._picture = None
            with device_memory(f"a {camera.width} × {camera.height} picture"):
                self._picture = spy.Tensor.zeros(self.gpu.device, shape=(pixels,), dtype="float")  # a word a pixel
        self.composite_module.packPicture(spy.grid((pixels,)), camera.width, camera.height,
                                          self._planes.storage.device_address, self._picture.storage.device_address)
        return self._read_back.read(self._picture).view(np.uint8).reshape(camera.height, camera.width, 4)

    def _frame_planes(self, camera: Camera, rays_per_pass: int | None = None,
                      timings: dict[str, float] | None = None, read: bool = True) -> np.ndarray | None:
        """Render the view's G-buffer planes on the device (again, counted, where a band was crowded); read back
        unless not ``read``."""
        import slangpy as spy

        pixels = camera.height * camera.width
        if self._frame is None or self._frame.shape[0] != pixels * OUTPUTS:  # one read-back of exactly the view
            self._frame = self._planes = None
            with device_memory(f"a {camera.width} × {camera.height} frame"):
                self._frame = spy.Tensor.zeros(self.gpu.device, shape=(pixels * OUTPUTS,), dtype="float")
                self._planes = spy.Tensor.zeros(self.gpu.device, shape=(pixels * PLANE_FLOATS,), dtype="float")
        if self._band_counts is None or self._band_counts.shape[0] < camera.height * 4:
            # each band's list counts and slots reserved (a band has a row at least)
            self._band_counts = spy.Tensor.zeros(self.gpu.device, shape=(camera.height * 4,), dtype="int")
        self._size_for_view(camera)
        planes, crowded = self._render_frame(camera, rays_per_pass, timings, counted=False, read=read)
        if crowded:
            planes, _crowded = self._render_frame(camera, rays_per_pass, timings, counted=True, read=read)
        self._make_room_for_next_view(camera, rays_per_pass)
        return planes

    def _render_frame(self, camera: Camera, rays_per_pass: int | None, timings: dict[str, float] | None,
                      counted: bool, read: bool = True) -> tuple[np.ndarray | None, bool]:
        """The view's G-buffer planes, read back, and whether some band listed more shaded segments than it had
        room for (not ``counted``: each band's list counts are copied aside on the device and read with the
        frame; the last band's batch then has its ``lists``)."""
        import slangpy as spy

        # each band's room for shaded segments and for slots, and (counted) its shaded segments
        rooms, slot_rooms, shaded = [], [], []
        for band, (_first, _rows, batch) in enumerate(self.camera_bands(camera, rays_per_pass, timings, self._frame,
                                                                        counted, kept_room=True)):
            rooms.append(batch.surface_capacity)
            slot_rooms.append(batch.slot_capacity)
            shaded.append(batch.lists.shaded)
            if not counted:
                encoder = self.gpu.device.create_command_encoder()
                encoder.copy_buffer(self._band_counts.storage, band * 16, batch.list_counts.storage, 0, 16)
                self.gpu.device.submit_command_buffer(encoder.finish())
        clock = PassClock(self.gpu, timings)
        pixels = camera.height * camera.width
        self.composite_module.finishPixel(spy.grid((pixels,)), pixels, self._frame.storage.device_address,
                                          self._planes.storage.device_address)
        clock.lap("G-buffer")
        planes = self._read_back.read(self._planes) if read else None
        clock.lap("read-back")
        crowded = False
        if not counted:
            counts = np.asarray(self._band_counts.to_numpy()).reshape(-1, 4)[:len(rooms)]
            batch.lists = WorkLists(*(int(c) for c in counts[-1, :3]))
            shaded = [int(count) for count in counts[:, 0]]
            self.band_work = [(rays, int(reserved), self._band_need(rays, int(reserved))) if slots is None
                              else (rays, slots, need)
                              for (rays, slots, need), reserved in zip(self.band_work, counts[:, 3], strict=True)]
            reserved = np.asarray([slots for _rays, slots, _need in self.band_work])
            crowded = bool(np.any(np.asarray(shaded) > np.asarray(rooms)) or np.any(reserved > np.asarray(slot_rooms)))
        self._learn_band_sizes([(rays, slots, count) for (rays, slots, _need), count in zip(self.band_work, shaded,
                                                                                            strict=True)])
        return planes, crowded


def even_bands(height: int, rows: int) -> int:
    """Rows per band of a view ``height`` rows high, at most ``rows``: as many bands as that takes, as even as
    whole tiles of rows allow (a band's last row of tiles takes as many slots for each of its rows as for four)."""
    if rows >= height:
        return height
    even = -(-height // -(-height // rows))
    tiled = -(-even // RayTiles.TILE[1]) * RayTiles.TILE[1]
    return tiled if tiled <= rows else whole_tiles(even)


def whole_tiles(rows: int) -> int:
    """``rows`` rounded down to whole tiles of rows (ray_tiles.slang's TILE_HEIGHT) where it has one: a band's
    last row of tiles takes as many slots for each of its rows as for four."""
    height = RayTiles.TILE[1]
    return rows - rows % height if rows >= height else rows


@dataclass
class SegmentAlbedo:
    slots: np.ndarray  # (N,) slot (sample · rays + ray) where each segment starts, in list order
    albedo: np.ndarray  # (N, K, 3)
    weight: np.ndarray  # (N, K) optical depth of each structure over the segment
